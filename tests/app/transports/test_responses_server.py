"""OpenAI's Responses and Conversations APIs against a started `kvchat serve` (SQLite and
Postgres), driven by the official `openai` client and the OpenAI Agents SDK: what those parse
is the contract. The dev model has random weights, so the tests bound what it may write (enum
parameters, `max_output_tokens`) and check what the server controls: ids, chains, KV reuse
(`cached_tokens`), the stream's events, schemas enforced by constrained decoding."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, NotFoundError, OpenAI

from kvchat_testing.service import Server, postgres_database

INSTRUCTIONS = "You are a terse assistant."
SHORT: dict[str, Any] = {"max_output_tokens": 8, "temperature": 0.0}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "tokyo", "lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather.",
        "parameters": WEATHER,
        "strict": True,
    }
]


@dataclass
class Started:
    server: Server
    other_key: str  # another owner's

    def client(self, key: str | None = None) -> OpenAI:
        return OpenAI(
            base_url=f"{self.server.url}/v1",
            api_key=key or self.server.key,
            max_retries=0,
            timeout=300,
        )


def create_key(env: dict[str, str], name: str, admin: bool = False) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "kvchat.app.cli",
            "keys",
            "create",
            "--name",
            name,
            *(["--admin"] if admin else []),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def started(
    request: pytest.FixtureRequest, dev_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Started]:
    data = tmp_path_factory.mktemp("responses")
    with contextlib.ExitStack() as stack:
        env = {"KVCHAT_DATA_DIR": str(data)}
        key = None
        if request.param == "postgres":
            env["KVCHAT_DATABASE_URL"] = stack.enter_context(postgres_database())
            key = create_key(env, "alice", admin=True)
        server = Server(dev_model, data, env=env, key=key).start()
        stack.callback(server.stop)
        assert server.key is not None
        yield Started(server, create_key(env, "bob"))


def test_a_response_to_a_string_with_instructions(started: Started) -> None:
    client = started.client()
    r = client.responses.create(
        model="dev", input="Say hello", instructions=INSTRUCTIONS, metadata={"run": "1"}, **SHORT
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete") and r.instructions == INSTRUCTIONS
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.output_text == item.content[0].text and r.output_text  # the SDK's property
    assert r.usage is not None and r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    assert again.metadata == {"run": "1"}
    (given,) = client.responses.input_items.list(r.id).data
    assert given.type == "message" and given.role == "user"
    assert given.content[0].text == "Say hello"  # type: ignore[union-attr]


def test_a_chain_reuses_the_previous_turns_kv(started: Started) -> None:
    """Five turns by previous_response_id: each one's cached tokens cover the previous turn's
    input and output (the session's pinned KV); then a fork of the chain reuses it up to the
    fork."""
    client = started.client()
    chain = [
        client.responses.create(model="dev", input="Turn 0", instructions=INSTRUCTIONS, **SHORT)
    ]
    for turn in range(1, 5):
        previous = chain[-1]
        r = client.responses.create(
            model="dev",
            input=f"Turn {turn}",
            instructions=INSTRUCTIONS,
            previous_response_id=previous.id,
            **SHORT,
        )
        assert r.previous_response_id == previous.id
        assert r.usage is not None and previous.usage is not None
        cached = r.usage.input_tokens_details.cached_tokens
        assert cached >= previous.usage.input_tokens + previous.usage.output_tokens, turn
        assert r.usage.input_tokens_details.cache_write_tokens == r.usage.input_tokens - cached
        chain.append(r)
    items = client.responses.input_items.list(chain[-1].id, order="asc").data
    assert [i.content[0].text for i in items] == ["Turn 4"]  # type: ignore[union-attr]
    # A fork at turn 2: a sibling of turn 3, over the same prefix.
    fork_point = chain[2]
    fork = client.responses.create(
        model="dev",
        input="Another way",
        instructions=INSTRUCTIONS,
        previous_response_id=fork_point.id,
        **SHORT,
    )
    assert fork.usage is not None and fork_point.usage is not None
    assert fork.usage.input_tokens_details.cached_tokens >= (
        fork_point.usage.input_tokens + fork_point.usage.output_tokens
    )
    # ...and the old branch goes on from where it was, again reusing up to the fork.
    on = client.responses.create(
        model="dev",
        input="Back",
        instructions=INSTRUCTIONS,
        previous_response_id=chain[-1].id,
        **SHORT,
    )
    assert on.usage is not None
    assert on.usage.input_tokens_details.cached_tokens >= (
        fork_point.usage.input_tokens + fork_point.usage.output_tokens
    )


def test_delete_store_false_other_owners_and_unknown_ids(started: Started) -> None:
    client = started.client()
    r = client.responses.create(model="dev", input="Keep this", **SHORT)
    # Another owner sees nothing of it.
    bob = started.client(started.other_key)
    with pytest.raises(NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(NotFoundError):
        bob.responses.create(model="dev", input="Mine now", previous_response_id=r.id, **SHORT)
    with pytest.raises(NotFoundError):
        bob.responses.delete(r.id)
    with pytest.raises(NotFoundError):
        bob.responses.input_items.list(r.id)
    for unknown in ("resp_0123456789abcdef0123456789abcdef", "nothing"):
        with pytest.raises(NotFoundError):
            client.responses.retrieve(unknown)
    # store=False: answered, not kept.
    ephemeral = client.responses.create(
        model="dev", input="Forget this", store=False, previous_response_id=r.id, **SHORT
    )
    assert ephemeral.status in ("completed", "incomplete") and ephemeral.output_text
    assert ephemeral.usage is not None and ephemeral.usage.input_tokens > 0
    with pytest.raises(NotFoundError):
        client.responses.retrieve(ephemeral.id)
    # Deleted: gone for retrieve and for continuing it.
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(NotFoundError):
        client.responses.create(model="dev", input="Go on", previous_response_id=r.id, **SHORT)


def test_streaming_gives_the_semantic_events_in_order(started: Started) -> None:
    client = started.client()
    events = list(
        client.responses.create(
            model="dev",
            input="Stream to me",
            stream=True,
            instructions=INSTRUCTIONS,
            max_output_tokens=12,
        )
    )
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == last.response.output_text  # type: ignore[union-attr]
    stored = client.responses.retrieve(last.response.id)  # type: ignore[union-attr]
    assert stored.output_text == deltas and stored.status == last.response.status  # type: ignore[union-attr]


def test_logprobs_as_the_official_client_parses_them(started: Started) -> None:
    from openai.types.responses import ResponseOutputText, ResponseTextDeltaEvent

    client = started.client()
    asked: dict[str, Any] = {
        "model": "dev",
        "input": "Count to three",
        "max_output_tokens": 8,
        "temperature": 0.0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    r = client.responses.create(**asked)
    assert r.top_logprobs == 2
    (item,) = r.output
    assert item.type == "message"
    (part,) = item.content
    assert isinstance(part, ResponseOutputText) and part.logprobs
    assert "".join(e.token for e in part.logprobs) == part.text == r.output_text
    for entry in part.logprobs:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2
        best = entry.top_logprobs[0]  # greedy decoding chose it
        assert (best.token, best.bytes, best.logprob) == (entry.token, entry.bytes, entry.logprob)
    events = list(client.responses.create(**asked, stream=True))
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert deltas and all(e.type == "response.output_text.delta" for e in deltas)
    streamed = [entry for e in deltas for entry in e.logprobs]
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    assert [e.logprob for e in streamed] == pytest.approx(
        [e.logprob for e in part.logprobs], abs=1e-4
    )
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [e.token for e in done.logprobs] == [e.token for e in streamed]
    final = events[-1].response  # type: ignore[union-attr]
    (final_part,) = final.output[0].content  # type: ignore[union-attr]
    assert [(e.token, e.logprob) for e in final_part.logprobs] == [
        (e.token, e.logprob) for e in done.logprobs
    ]
    # Not stored: retrieved later, the same response without them.
    again = client.responses.retrieve(r.id)
    (again_part,) = again.output[0].content  # type: ignore[union-attr]
    assert again.output_text == r.output_text and again_part.logprobs == []


def test_a_resumed_stream_gets_exactly_the_missing_events(started: Started) -> None:
    client = started.client()
    seen = []
    with client.responses.create(
        model="dev",
        input="Write at length",
        stream=True,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"ignore_eos": True, "seed": 1},
    ) as stream:
        for event in stream:
            seen.append(event)
            if event.sequence_number == 9:
                break  # and leave: the reply goes on for the grace period
    response_id = seen[0].response.id  # type: ignore[union-attr]
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=9))
    assert [e.sequence_number for e in rest] == list(range(10, 10 + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    everything = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in everything] == [e.model_dump() for e in seen + rest]
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == client.responses.retrieve(response_id).output_text


def test_a_required_tool_call_then_its_output_continues_the_chain(started: Started) -> None:
    client = started.client()
    r = client.responses.create(
        model="dev",
        input="Weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=1.0,
    )
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert call.call_id and call.id
    after = client.responses.create(
        model="dev",
        previous_response_id=r.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}],
        **SHORT,
    )
    assert after.usage is not None and r.usage is not None
    assert after.usage.input_tokens_details.cached_tokens >= (
        r.usage.input_tokens + r.usage.output_tokens
    )
    (given,) = client.responses.input_items.list(after.id).data
    assert given.type == "function_call_output" and given.call_id == call.call_id
    assert given.output == "sunny, 21"
    # An output for a call that was never made is a 400 naming it.
    bad = httpx.post(
        f"{started.server.url}/v1/responses",
        headers=started.server.headers(),
        json={
            "model": "dev",
            "previous_response_id": r.id,
            "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input.0.call_id"


def test_text_format_json_schema_is_valid_for_its_schema(started: Started) -> None:
    client = started.client()
    r = client.responses.create(
        model="dev",
        input="The weather, as JSON",
        max_output_tokens=64,
        temperature=1.0,
        text={
            "format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
        },
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"


def test_a_conversation_made_with_items_then_continued_by_a_response(started: Started) -> None:
    client = started.client()
    conv = client.conversations.create(
        items=[
            {"type": "message", "role": "user", "content": "Hi, I am Ada."},
            {"type": "message", "role": "assistant", "content": "Hello Ada."},
        ],
        metadata={"topic": "intro"},
    )
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert isinstance(conv.created_at, int) and conv.metadata == {"topic": "intro"}
    updated = client.conversations.update(conv.id, metadata={"topic": "names"})
    assert updated.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "names"}
    r = client.responses.create(model="dev", input="Who am I?", conversation=conv.id, **SHORT)
    assert r.conversation is not None and r.conversation.id == conv.id
    r2 = client.responses.create(model="dev", input="Again?", conversation={"id": conv.id}, **SHORT)
    assert r2.usage is not None and r.usage is not None
    assert r2.usage.input_tokens_details.cached_tokens >= (
        r.usage.input_tokens + r.usage.output_tokens
    )
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert items[3].id == r.output[0].id and items[5].id == r2.output[0].id
    newest_first = client.conversations.items.list(conv.id, limit=2).data
    assert [i.id for i in newest_first] == [items[5].id, items[4].id]
    # The same conversation through kvchat's own routes.
    messages = httpx.get(
        f"{started.server.url}/v1/conversations/{conv.id}/messages",
        headers=started.server.headers(),
    ).json()["data"]
    assert [m["id"] for m in messages] == [i.id for i in items]


def test_an_agent_calls_its_tool_through_the_responses_api(started: Started) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["paris", "tokyo", "lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> None:
        client = AsyncOpenAI(
            base_url=f"{started.server.url}/v1",
            api_key=started.server.key,
            max_retries=0,
            timeout=300,
        )
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="dev", openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=1.0
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        result = await Runner.run(agent, "What is the weather?")
        assert calls and result.final_output == f"sunny in {calls[-1]}"
        # Through a conversation: a second run continues the first one's.
        conversation = await client.conversations.create()
        first = await Runner.run(agent, "Weather, please.", conversation_id=conversation.id)
        second = await Runner.run(agent, "And again.", conversation_id=conversation.id)
        assert first.final_output == f"sunny in {calls[-2]}"
        assert second.final_output == f"sunny in {calls[-1]}"
        items = (await client.conversations.items.list(conversation.id, order="asc")).data
        assert [i.type for i in items] == ["message", "function_call", "message", "function_call"]
        assert [getattr(i, "role", None) for i in items[::2]] == ["user", "user"]
        assert items[2].content[0].text == "And again."  # type: ignore[union-attr]
        last = second.raw_responses[-1].usage
        before = first.raw_responses[-1].usage
        assert last.input_tokens_details.cached_tokens >= (
            before.input_tokens + before.output_tokens
        )
        await client.close()

    asyncio.run(run())
