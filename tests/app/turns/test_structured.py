"""Structured output through the real server process and the official openai client, on the
random-weight dev model, which writes a valid call or valid JSON only if its decoding is
constrained: tool_choice required and named, parallel calls, response_format json_schema and
json_object, streaming and not, 20 seeds per case sent together (so they batch); an agent
loop; the conversations API and the WebSocket `message` frame.

The schemas bound every free-form value (string maxLength, integer and number ranges,
number multipleOf, array maxItems): a random model picks among the allowed tokens uniformly,
so an unbounded string or number would run to max_tokens (a correct outcome, "length", but
not the one under test). Bounds are ordinary JSON-schema keywords the grammar enforces."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import websockets
from openai import AsyncOpenAI, OpenAI

from kvchat_testing.service import Server

SEEDS = range(20)
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "place": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.25},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.25},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["place", "unit"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "ids": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": 1,
                "maxItems": 4,
            },
            "names": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["ids", "names"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "size": {"enum": [1, 2, 3, 5, 8]},
            "mode": {"const": "fast"},
        },
        "required": ["color", "size", "mode"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -100, "maximum": 100},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125},
            "score": {"type": ["number", "null"], "minimum": 0, "maximum": 10, "multipleOf": 0.5},
        },
        "required": ["count", "ratio", "score"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 50},
            "note": {"type": "string", "maxLength": 8},
            "urgent": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
}
LOOKUP = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 8}},
    "required": ["q"],
    "additionalProperties": False,
}
MESSAGES = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Do the thing."},
]


def tools_for(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": "act", "description": "Act.", "parameters": schema},
        },
        {
            "type": "function",
            "function": {"name": "lookup", "description": "Look up.", "parameters": LOOKUP},
        },
    ]


def integers_are_ints(value: Any, schema: dict[str, Any]) -> None:
    """A schema's integers came out as JSON integers (no `3.0`), recursively."""
    if schema.get("type") == "integer" or (
        "items" in schema and schema["items"].get("type") == "integer"
    ):
        for v in value if isinstance(value, list) else [value]:
            assert type(v) is int, (v, schema)
    for key, sub in schema.get("properties", {}).items():
        if isinstance(value, dict) and key in value:
            integers_are_ints(value[key], sub)


def check_arguments(name: str, arguments: str, schema: dict[str, Any]) -> dict[str, Any]:
    value = json.loads(arguments)
    jsonschema.validate(value, LOOKUP if name == "lookup" else schema)
    integers_are_ints(value, LOOKUP if name == "lookup" else schema)
    assert isinstance(value, dict)
    return value


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(dev_model, tmp_path_factory.mktemp("structured")).start()
    try:
        yield server
    finally:
        server.stop()


def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0, timeout=300)


Reply = tuple[str | None, str | None, list[tuple[str, str, str]]]  # finish, content, calls


async def ask(api: AsyncOpenAI, stream: bool, **fields: Any) -> Reply:
    """(finish_reason, content, [(id, name, arguments)]) of one choice, streamed or not."""
    body = {"model": "dev", "temperature": 1.0, **fields}
    if not stream:
        r = await api.chat.completions.create(**body)
        choice = r.choices[0]
        calls = [
            (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
        ]
        return choice.finish_reason, choice.message.content, calls
    content: str | None = None
    calls: dict[int, list[str | None]] = {}
    finish = None
    async for chunk in await api.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, [None, None, ""])
                if delta.id is not None:  # id and name come whole, in the first delta
                    assert entry[0] is None and delta.function is not None
                    entry[0], entry[1] = delta.id, delta.function.name
                if delta.function is not None and delta.function.arguments:
                    entry[2] = (entry[2] or "") + delta.function.arguments
            if choice.finish_reason is not None:
                assert finish is None
                finish = choice.finish_reason
    ordered = [calls[i] for i in sorted(calls)]
    assert list(sorted(calls)) == list(range(len(calls)))
    return finish, content, [(str(i), str(n), str(a)) for i, n, a in ordered]


def ask_all(server: Server, stream: bool, **fields: Any) -> list[Reply]:
    """One request per seed, all in flight together."""

    async def run() -> list[Reply]:
        api = client(server)
        try:
            return list(
                await asyncio.gather(*(ask(api, stream, seed=seed, **fields) for seed in SEEDS))
            )
        finally:
            await api.close()

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["required", "named"])
@pytest.mark.parametrize("schema_name", list(SCHEMAS))
def test_forced_tool_calls_validate(
    server: Server, schema_name: str, mode: str, stream: bool
) -> None:
    schema = SCHEMAS[schema_name]
    choice: Any = (
        "required" if mode == "required" else {"type": "function", "function": {"name": "act"}}
    )
    replies = ask_all(
        server,
        stream,
        messages=MESSAGES,
        tools=tools_for(schema),
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=160,
    )
    arguments = []
    for finish, content, calls in replies:
        assert finish == "tool_calls", (finish, content, calls)
        assert content is None
        ((call_id, name, args),) = calls
        assert call_id.startswith("call_")
        assert name == "act" if mode == "named" else name in ("act", "lookup")
        check_arguments(name, args, schema)
        arguments.append(args)
    assert len({c[0] for _, _, calls in replies for c in calls}) == len(SEEDS)  # unique ids
    assert len(set(arguments)) > 1  # the seeds were used


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("schema_name", list(SCHEMAS))
def test_json_schema_content_validates(server: Server, schema_name: str, stream: bool) -> None:
    schema = SCHEMAS[schema_name]
    replies = ask_all(
        server,
        stream,
        messages=MESSAGES,
        max_tokens=160,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": schema_name, "schema": schema, "strict": True},
        },
    )
    texts = []
    for finish, content, calls in replies:
        assert finish == "stop" and not calls, (finish, content)
        assert content is not None
        value = json.loads(content)
        jsonschema.validate(value, schema)
        integers_are_ints(value, schema)
        texts.append(content)
    assert len(set(texts)) > 1


def test_parallel_tool_calls_give_one_or_more_valid_calls(server: Server) -> None:
    schema = SCHEMAS["flat"]
    replies = ask_all(
        server,
        False,
        messages=MESSAGES,
        tools=tools_for(schema),
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=400,
    )
    counts = []
    for finish, content, calls in replies:
        assert len(calls) >= 1
        for _, name, args in calls:
            check_arguments(name, args, schema)
        if finish == "tool_calls":
            assert content is None
        else:  # out of tokens inside a further call: its start stays content
            assert finish == "length" and content is not None
        counts.append(len(calls))
    assert max(counts) >= 2  # more than one call was possible


def test_json_object_is_an_object_or_runs_out_of_tokens(server: Server) -> None:
    replies = ask_all(
        server, True, messages=MESSAGES, max_tokens=24, response_format={"type": "json_object"}
    )
    for finish, content, _ in replies:
        assert content is not None and content.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert finish == "length"


def test_auto_stays_free_and_none_offers_no_tools(server: Server) -> None:
    tools = tools_for(SCHEMAS["flat"])
    auto = ask_all(server, False, messages=MESSAGES, tools=tools, tool_choice="auto", max_tokens=12)
    # Unconstrained, a random model writes no call: content, cut at max_tokens or ended.
    assert all(f in ("stop", "length") and not calls for f, _, calls in auto)
    assert sum(1 for _, content, _ in auto if content) >= len(SEEDS) - 2
    api = OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)
    usage = {}
    for choice in ("auto", "none"):
        r = api.chat.completions.create(
            model="dev",
            messages=MESSAGES,
            tools=tools,  # type: ignore[arg-type]
            tool_choice=choice,
            max_tokens=1,
            temperature=0,
        )
        assert r.usage is not None
        usage[choice] = r.usage.prompt_tokens
    plain = api.chat.completions.create(
        model="dev",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=1,
        temperature=0,
    )
    assert plain.usage is not None and usage["none"] == plain.usage.prompt_tokens < usage["auto"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_tokens_before_the_call_closes_is_length_not_an_error(
    server: Server, stream: bool
) -> None:
    async def run() -> list[Reply]:
        api = client(server)
        try:
            return list(
                await asyncio.gather(
                    *(
                        ask(
                            api,
                            stream,
                            messages=MESSAGES,
                            tools=tools_for(SCHEMAS["flat"]),
                            tool_choice=choice,
                            max_tokens=budget,
                            seed=1,
                        )
                        for choice in (
                            "required",
                            {"type": "function", "function": {"name": "act"}},
                        )
                        for budget in (1, 2, 9)
                    )
                )
            )
        finally:
            await api.close()

    for finish, content, calls in asyncio.run(run()):
        assert finish == "length" and not calls
        assert content is not None and "<tool_call>".startswith(content[:11])


def test_an_agent_loop_of_five_rounds(server: Server) -> None:
    api = OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)
    schema = SCHEMAS["numbers"]
    tools = tools_for(schema)
    messages: list[Any] = [{"role": "system", "content": "You call tools, then answer."}]
    cached = []
    for round_ in range(5):
        messages.append({"role": "user", "content": f"Round {round_}: act."})
        call = api.chat.completions.create(
            model="dev",
            messages=messages,
            tools=tools,
            tool_choice="required",  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=160,
            seed=round_,
            extra_headers={"X-Session-Id": "agent-loop"},
        )
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls"
        ((tool_call),) = choice.message.tool_calls or []
        args = check_arguments(tool_call.function.name, tool_call.function.arguments, schema)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append(
            {
                "role": "tool",
                "tool_call_id": tool_call.id,
                "content": json.dumps({"ok": True, "echo": args}),
            }
        )
        reply = api.chat.completions.create(
            model="dev",
            messages=messages,
            tools=tools,
            tool_choice="auto",  # type: ignore[arg-type]
            max_tokens=12,
            seed=round_,
            extra_headers={"X-Session-Id": "agent-loop"},
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert not reply.choices[0].message.tool_calls
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        assert call.usage is not None and call.usage.prompt_tokens_details is not None
        cached.append(call.usage.prompt_tokens_details.cached_tokens)
    # Each round's prompt extends the last: from round 2 on, most of it is reused.
    assert all(c and c > 0 for c in cached[1:]), cached


def test_conversations_api_takes_the_same_fields(server: Server) -> None:
    http = httpx.Client(base_url=server.url, headers=server.headers(), timeout=300)
    schema = SCHEMAS["enums"]
    conv = http.post("/v1/conversations", json={}).json()["id"]
    r = http.post(
        f"/v1/conversations/{conv}/messages",
        json={
            "content": "Act.",
            "tools": tools_for(schema),
            "max_tokens": 160,
            "seed": 3,
            "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "act"}},
        },
    )
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["finish_reason"] == "tool_calls"
    ((call),) = message["tool_calls"]
    check_arguments(call["function"]["name"], call["function"]["arguments"], schema)
    r = http.post(
        f"/v1/conversations/{conv}/messages",
        json={
            "role": "tool",
            "tool_call_id": call["id"],
            "content": "done",
            "max_tokens": 160,
            "seed": 4,
            "tools": tools_for(schema),
            "tool_choice": "none",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "summary", "schema": SCHEMAS["optional"]},
            },
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r.json()["content"]), SCHEMAS["optional"])
    # An unsupported feature is refused before anything is stored.
    before = http.get(f"/v1/conversations/{conv}/messages").json()["data"]
    r = http.post(
        f"/v1/conversations/{conv}/messages",
        json={
            "content": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}},
            },
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in r.json()["error"]["message"]
    assert http.get(f"/v1/conversations/{conv}/messages").json()["data"] == before


def test_websocket_message_frame_takes_the_same_fields(server: Server) -> None:
    http = httpx.Client(base_url=server.url, headers=server.headers(), timeout=300)
    conv = http.post("/v1/conversations", json={}).json()["id"]
    schema = SCHEMAS["nested"]

    async def run() -> tuple[str, dict[str, Any], dict[str, Any]]:
        url = f"ws://127.0.0.1:{server.port}/v1/conversations/{conv}/ws"
        async with websockets.connect(url, additional_headers=server.headers()) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "message",
                        "content": "bad",
                        "tool_choice": "required",
                        "tools": [
                            {
                                "type": "function",
                                "function": {
                                    "name": "f",
                                    "parameters": {
                                        "type": "object",
                                        "properties": {"a": {"not": {}}},
                                    },
                                },
                            }
                        ],
                    }
                )
            )
            error = json.loads(await ws.recv())
            await ws.send(
                json.dumps(
                    {
                        "type": "message",
                        "content": "Where?",
                        "max_tokens": 160,
                        "seed": 9,
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "where", "schema": schema},
                        },
                    }
                )
            )
            text = ""
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "delta":
                    text += frame["text"]
                if frame["type"] in ("done", "error"):
                    return text, frame, error

    text, done, error = asyncio.run(run())
    assert error["type"] == "error" and error["param"] == "tools.0.function.parameters"
    assert "not" in error["message"]
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), schema)
    stored = http.get(f"/v1/conversations/{conv}/messages").json()["data"]
    assert stored[-1]["content"] == text


def test_logprobs_of_constrained_output_stay_finite(server: Server) -> None:
    api = OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)
    r = api.chat.completions.create(
        model="dev",
        messages=MESSAGES,
        max_tokens=160,
        seed=2,
        logprobs=True,  # type: ignore[arg-type]
        top_logprobs=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "e", "schema": SCHEMAS["enums"]},
        },
    )
    choice = r.choices[0]
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMAS["enums"])
    assert choice.logprobs is not None and choice.logprobs.content
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    # Where the schema leaves one way on (`"mode": "fast"`), fewer than 20 alternatives exist.
    assert min(len(t.top_logprobs) for t in choice.logprobs.content) < 20
    for t in choice.logprobs.content:
        assert all(alt.logprob <= 0 for alt in t.top_logprobs)
