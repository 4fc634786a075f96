"""Tools on the default model, SmolLM2-135M-Instruct, whose chat template has no tool format
(the generic one stands in), against a started `kvchat serve`: every `tool_choice` gives
well-formed OpenAI tool calls on Chat Completions, streamed and not, with the official client;
a tool turn's next request prefills only what is new (the history reads as the model wrote
it); the conversations API, the WebSocket, Responses and the AI SDK stream carry the same calls;
and the OpenAI Agents SDK completes a two-tool task. Greedy decoding, so every run asks the
model the same."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import websockets
from openai import AsyncOpenAI, OpenAI

from kvchat_testing.service import Server

MODEL = "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": CITY,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current local time in a city.",
            "parameters": CITY,
        },
    },
]
NAMES = {"get_weather", "get_time"}
CALL_ID = re.compile(r"call_[A-Za-z0-9_-]{24}")
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 96}
QUESTION = "What is the weather in Paris right now?"  # one call, greedy
BOTH = "What is the weather in Paris?"  # two calls, greedy: the weather and the time
ANSWERED = "What is the capital of France?"  # under auto, answered in words


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        smollm2_dir, tmp_path_factory.mktemp("tools"), env={"KVCHAT_SERVED_MODEL_NAME": MODEL}
    ).start(timeout=600)
    yield server
    server.stop()


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0, timeout=300)


def check_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each call well formed: a fresh call id, an offered function, arguments a JSON object
    valid for its parameters. Returns (name, arguments) pairs."""
    assert calls
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and all(CALL_ID.fullmatch(i) for i in ids)
    out = []
    for call in calls:
        assert call.type == "function" and call.function.name in NAMES
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, CITY)
        out.append((call.function.name, arguments))
    return out


def test_every_tool_choice_gives_well_formed_calls(server: Server) -> None:
    openai = client(server)
    ask = [{"role": "user", "content": QUESTION}]
    required = openai.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", **GREEDY
    )
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.content is None
    assert check_calls(required.choices[0].message.tool_calls) == [
        ("get_weather", {"city": "Paris"})
    ]
    named = openai.chat.completions.create(
        model=MODEL,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **GREEDY,
    )
    assert named.choices[0].finish_reason == "tool_calls"
    assert {n for n, _ in check_calls(named.choices[0].message.tool_calls)} == {"get_time"}
    # auto: the model chooses; this question it answers in words, which arrive as text (the
    # format's JSON never reaches the client).
    auto = openai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ANSWERED}],
        tools=TOOLS,
        tool_choice="auto",
        **GREEDY,
    )
    message = auto.choices[0].message
    assert message.tool_calls is None and message.content
    assert message.content.startswith("The capital of France is Paris")
    # Two calls in one reply where parallel calls are allowed; exactly one where they are not.
    both = [{"role": "user", "content": BOTH}]
    parallel = openai.chat.completions.create(
        model=MODEL, messages=both, tools=TOOLS, tool_choice="required", **GREEDY
    )
    assert check_calls(parallel.choices[0].message.tool_calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Paris"}),
    ]
    single = openai.chat.completions.create(
        model=MODEL,
        messages=both,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    assert check_calls(single.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    # none: no tools offered; a plain reply.
    none = openai.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="none", **GREEDY
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_streamed_calls_and_text_are_the_unstreamed_ones(server: Server) -> None:
    openai = client(server)
    ask = [{"role": "user", "content": QUESTION}]
    whole = openai.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", **GREEDY
    )
    stream = openai.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", stream=True, **GREEDY
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first delta of a call: id and name
                    assert delta.id is not None and delta.function.name in NAMES
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments))
        for c in whole.choices[0].message.tool_calls
    ]
    # An answer streams as text, piece by piece, as it is decoded.
    chat = [{"role": "user", "content": ANSWERED}]
    text = openai.chat.completions.create(model=MODEL, messages=chat, tools=TOOLS, **GREEDY)
    pieces = [
        c.choices[0].delta.content
        for c in openai.chat.completions.create(
            model=MODEL, messages=chat, tools=TOOLS, stream=True, **GREEDY
        )
        if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 3 and "".join(pieces) == text.choices[0].message.content


def test_a_tool_loop_prefills_only_what_is_new(server: Server) -> None:
    """An agent's loop on Chat Completions (X-Session-Id): the call, its result, the answer.
    The second request's prompt extends the first one's prompt and reply token for token."""
    openai = client(server).with_options(default_headers={"X-Session-Id": "weather-loop"})
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = openai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", **GREEDY
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 °C"})
    second = openai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **GREEDY)
    assert first.usage and second.usage
    before = first.usage.prompt_tokens + first.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert before - 1 <= cached <= before
    assert second.usage.prompt_tokens - cached < 40  # the result and the reply's opening


def conversation_turn(server: Server, conv: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        f"{server.url}/v1/conversations/{conv}/messages",
        headers=server.headers(),
        json={**body, **GREEDY},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_conversations_api_and_its_websocket(server: Server) -> None:
    conv = httpx.post(f"{server.url}/v1/conversations", headers=server.headers(), json={}).json()[
        "id"
    ]
    reply = conversation_turn(
        server, conv, {"content": QUESTION, "tools": TOOLS, "tool_choice": "required"}
    )
    assert reply["finish_reason"] == "tool_calls"
    (call,) = reply["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    answer = conversation_turn(
        server,
        conv,
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 °C", "tools": TOOLS},
    )
    previous = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
    assert answer["usage"]["cached_tokens"] >= previous - 1
    stored = httpx.get(
        f"{server.url}/v1/conversations/{conv}/messages", headers=server.headers()
    ).json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["id"] == call["id"] and not stored[1]["content"]

    async def over_the_socket() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{server.port}/v1/conversations/{conv}/ws"
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "message",
                        "content": "And what time is it in Tokyo?",
                        "tools": TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                        **GREEDY,
                    }
                )
            )
            frames = []
            while not frames or frames[-1]["type"] != "done":
                frames.append(json.loads(await ws.recv()))
            return frames

    frames = asyncio.run(over_the_socket())
    calls = [f for f in frames if f["type"] == "tool_call"]
    assert calls[0]["name"] == "get_time" and CALL_ID.fullmatch(calls[0]["id"])
    arguments = "".join(f["arguments"] for f in calls if f["index"] == 0)
    jsonschema.validate(json.loads(arguments), CITY)
    assert frames[-1]["finish_reason"] == "tool_calls"
    assert not [f for f in frames if f["type"] == "delta"]


def test_responses_function_calls(server: Server) -> None:
    openai = client(server)
    tools: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
    first = openai.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=96,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = openai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
        temperature=0,
        max_output_tokens=96,
    )
    assert second.output_text and second.usage
    assert first.usage is not None
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= before - 1


def test_the_ai_sdk_stream_carries_the_call(server: Server) -> None:
    body = {
        "id": "tools-ui-chat",
        "messages": [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": QUESTION}]}],
        "tools": TOOLS,
        "tool_choice": "required",
        **GREEDY,
    }
    parts = []
    with httpx.stream(
        "POST", f"{server.url}/v1/ui/chat", json=body, headers=server.headers(), timeout=300
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[len("data: ") :]))
    available = [p for p in parts if p["type"] == "tool-input-available"]
    assert [(p["toolName"], p["input"]) for p in available] == [("get_weather", {"city": "Paris"})]
    assert next(p for p in parts if p["type"] == "finish")["finishReason"] == "tool-calls"


def test_the_agents_sdk_completes_a_two_tool_task(server: Server) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(("get_weather", city))
        return "sunny, 21 °C"

    @function_tool
    def get_time(city: str) -> str:
        """The current local time in a city."""
        ran.append(("get_time", city))
        return "14:05"

    async def run() -> Any:
        openai = AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=server.key, max_retries=0, timeout=300
        )
        agent = Agent(
            name="assistant",
            tools=[get_weather, get_time],
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=openai),
            model_settings=ModelSettings(
                tool_choice="required",
                temperature=0,
                max_tokens=96,
                extra_headers={"X-Session-Id": "two-tools"},
            ),
        )
        result = await Runner.run(agent, BOTH, max_turns=3)
        await openai.close()
        return result

    result = asyncio.run(run())
    assert sorted(ran) == [("get_time", "Paris"), ("get_weather", "Paris")]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # The step after the calls prefilled only what was new: the results and the prompt.
    first, last = result.raw_responses[0].usage, result.raw_responses[-1].usage
    assert last.input_tokens_details.cached_tokens >= first.input_tokens + first.output_tokens - 1


# Open WebUI's built-in create_skill, as its page sends it: under it the model loops inside the
# call's `files` (`{"path": "skill_file_path", ...}, {"path": "skill_file_path", ...}, ...`).
CREATE_SKILL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "create_skill",
        "description": "Create a private workspace skill with SKILL.md and optional UTF-8 "
        "supporting files. No terminal is needed.",
        "parameters": {
            "type": "object",
            "properties": {
                "id": {"description": "Unique lowercase skill slug.", "type": "string"},
                "name": {"description": "Display name.", "type": "string"},
                "content": {"description": "Complete SKILL.md text.", "type": "string"},
                "files": {
                    "description": "Optional supporting files, each with path and content.",
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string"},
                            "content": {"type": "string"},
                            "encoding": {"const": "base64", "type": "string"},
                        },
                        "required": ["path", "content"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["id", "name", "content"],
        },
    },
}


def cut_replies(server: Server) -> dict[str, float]:
    metrics = httpx.get(f"{server.url}/metrics").text
    found = re.findall(r'kvchat:cut_tool_replies_total\{outcome="(\w+)"\} ([0-9.]+)', metrics)
    return {outcome: float(value) for outcome, value in found}


def test_a_reply_caught_in_a_loop_or_repeating_the_last_calls_is_answered(
    server: Server,
) -> None:
    """What keeps a client that runs tools until the model answers (Open WebUI's page) out of a
    loop: a reply caught in a loop before its first call is whole, and one that would only make
    the last turn's calls again, are answered without a call; nothing of the dropped attempt
    reaches the client, and the usage counts what the request found cached."""
    openai = client(server)
    before = cut_replies(server)
    r = openai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello!"}],
        tools=[CREATE_SKILL],
        temperature=0,
        max_tokens=256,  # room for the loop to show (its cycle is about 25 tokens)
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content and not r.choices[0].message.content.startswith("{")
    after = cut_replies(server)
    assert after.get("answered_loop", 0) == before.get("answered_loop", 0) + 1
    # The last turn's call again: answered instead.
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = openai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", **GREEDY
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "[]"},
    ]
    second = openai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **GREEDY)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert cut_replies(server).get("answered_repeat", 0) == after.get("answered_repeat", 0) + 1
    # Its cached tokens are what the request found (not the whole prompt, which the dropped
    # attempt prefilled): the new tool result was computed.
    assert second.usage is not None
    assert second.usage.prompt_tokens_details.cached_tokens + 4 <= second.usage.prompt_tokens
