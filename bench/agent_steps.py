"""One step of bench/agents.py's agent runs as the wire saw it: the OpenAI client's transport
records every request and its streamed reply (Chat Completions chunks or Responses events), and
what the server's counters (tokens the engine prefilled, replies cut or re-run) grew by while it
ran; a `Step` is read from that record (the reply's own usage and calls), and the conversation
its prompt renders (`conversation`: Chat Completions messages and tools) is counted by the
server's POST /v1/tokenize. The per-step arithmetic is here too: prefilled = prompt - cached;
new = the tokens of the prompt after the previous reply (the messages after it and the
generation prompt), so the prompt less the previous prompt and the previous reply as this prompt
holds it (a reply kvchat cut is stored shorter than its completion tokens); and the goal (a step
after the first prefills at most GOAL times its new tokens)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
from prometheus_client.parser import text_string_to_metric_families

GOAL = 1.1  # a step after the first prefills at most this times its new tokens


@dataclass(frozen=True)
class Counters:
    """The server's counters a request is measured by (GET /v1/admin/memory, /metrics)."""

    computed: int = 0  # tokens the engine prefilled (prefill_sources.computed)
    answered: int = 0  # replies re-run as an answer (kvchat:cut_tool_replies{answered_*})
    dropped: int = 0  # replies kvchat ended at a repeat or a loop (kvchat:cut_tool_replies)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.computed - other.computed,
            self.answered - other.answered,
            self.dropped - other.dropped,
        )


@dataclass(frozen=True)
class ModelCall:
    """A call as the model wrote it."""

    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class TokenCounts:
    """POST /v1/tokenize's count of the conversation a step's prompt renders."""

    count: int  # the whole prompt: its prompt tokens, when it renders as the request did
    num_after_reply: int | None  # after the last assistant reply; None: there is none


@dataclass(frozen=True)
class Step:
    """One model request of an agent run, from its reply's usage and output."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    calls: tuple[ModelCall, ...]
    counters: Counters | None = None  # what the server's counters grew by during the request
    ttft_ms: float | None = None  # request sent -> the first generated event
    latency_ms: float | None = None  # request sent -> the stream's end
    request_bytes: int = 0
    tokenized: TokenCounts | None = None  # POST /v1/tokenize of the conversation it renders

    @property
    def prefilled(self) -> int:
        """What the reply's usage says was prefilled."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def computed(self) -> int | None:
        """What the engine prefilled during the request, by its own count."""
        return None if self.counters is None else self.counters.computed

    @property
    def prefill_work(self) -> int:
        """The larger of the usage's prefilled and the engine's count: the usage of a reply the
        server re-ran (kvchat's answer-instead) is its last attempt's alone."""
        return max(self.prefilled, self.computed or 0)


def new_tokens(step: Step) -> int:
    """The tokens of the step's prompt after the previous reply (the messages after it, the
    generation prompt), by the server's count of the conversation it renders."""
    if step.tokenized is None or step.tokenized.num_after_reply is None:
        raise ValueError(f"a step not counted after a reply: {step}")
    return step.tokenized.num_after_reply


def held_reply(previous: Step, step: Step) -> int:
    """The previous reply as the step's prompt holds it: the prompt less the previous prompt and
    the new tokens (its text and calls, closed, and its end of turn)."""
    return step.prompt_tokens - previous.prompt_tokens - new_tokens(step)


def new_by_completion(previous: Step, step: Step) -> int:
    """The step's prompt less the previous step's prompt and completion tokens: its new tokens
    only when the prompt holds the previous reply exactly as generated."""
    return step.prompt_tokens - previous.prompt_tokens - previous.completion_tokens


def ratio(prefilled: int, new: int) -> float:
    """prefilled / new; with nothing new, 0 when nothing was prefilled, else infinite."""
    if new <= 0:
        return math.inf if prefilled > 0 else 0.0
    return prefilled / new


def meets_goal(step: Step) -> bool:
    return ratio(step.prefill_work, new_tokens(step)) <= GOAL


CUT_REPLIES = "kvchat:cut_tool_replies_total"


def cut_replies(metrics: str) -> tuple[int, int]:
    """From /metrics' text: the tool-call replies kvchat re-ran as an answer (outcomes
    `answered_*`: nothing was sent yet) and those it ended itself (a repeated call, a loop)."""
    answered = dropped = 0
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == CUT_REPLIES:
                if sample.labels["outcome"].startswith("answered"):
                    answered += int(sample.value)
                else:
                    dropped += int(sample.value)
    return answered, dropped


# -- reading a stream ------------------------------------------------------------------------------


def sse_events(lines: Sequence[str]) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in lines
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def chat_step(events: Sequence[Mapping[str, Any]]) -> Step | None:
    """A Chat Completions stream's step (None when it carries no usage: it failed)."""
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    if usage is None:
        return None
    calls: dict[int, list[str]] = {}  # index -> [name, arguments] as the deltas build them
    for event in events:
        for choice in event.get("choices") or []:
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], ["", ""])
                function = delta.get("function") or {}
                call[0] += function.get("name") or ""
                call[1] += function.get("arguments") or ""
    details = usage.get("prompt_tokens_details") or {}
    return Step(
        usage["prompt_tokens"],
        details.get("cached_tokens") or 0,
        usage["completion_tokens"],
        tuple(ModelCall(n, a) for _, (n, a) in sorted(calls.items())),
    )


TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def terminal_response(events: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A Responses stream's response, from its terminal event (None when there is none)."""
    return next((e["response"] for e in reversed(events) if e.get("type") in TERMINAL), None)


def responses_step(events: Sequence[Mapping[str, Any]]) -> Step | None:
    """A Responses stream's step, from its terminal event (None when there is none)."""
    response = terminal_response(events)
    if response is None or not response.get("usage"):
        return None
    usage = response["usage"]
    details = usage.get("input_tokens_details") or {}
    return Step(
        usage["input_tokens"],
        details.get("cached_tokens") or 0,
        usage["output_tokens"],
        tuple(
            ModelCall(item["name"], item["arguments"])
            for item in response["output"]
            if item["type"] == "function_call"
        ),
    )


def is_generated(event: Mapping[str, Any]) -> bool:
    """A stream event that carries what the model generated (a call or text), on either API."""
    if "choices" in event:
        return any(
            c["delta"].get("tool_calls") or c["delta"].get("content") for c in event["choices"]
        )
    return event.get("type") in ("response.output_item.added", "response.output_text.delta")


# -- the conversation a step renders ---------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """A step's prompt as POST /v1/tokenize takes it: Chat Completions messages and tools."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None

    def tokenize_request(self) -> dict[str, Any]:
        return {"messages": self.messages} | ({"tools": self.tools} if self.tools else {})


def token_counts(conversation: Conversation, answer: Mapping[str, Any]) -> TokenCounts:
    """/v1/tokenize's answer for `conversation` (`count`, and `messages`: each message's
    segment, in order; the generation prompt is the rest): the tokens after its last assistant
    reply are the whole count less the segments up to and including that reply's."""
    per_message: list[int] = answer["messages"]
    if len(per_message) != len(conversation.messages):
        raise ValueError(f"{len(per_message)} counts for {len(conversation.messages)} messages")
    replies = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    if not replies:
        return TokenCounts(answer["count"], None)
    return TokenCounts(answer["count"], answer["count"] - sum(per_message[: replies[-1] + 1]))


def conversation(exchanges: Sequence[Exchange]) -> Conversation:
    """What the last of a run's exchanges (each answered) renders. Chat Completions: its own
    messages and tools (none under tool_choice "none", which renders none). Responses: the
    chain up to it (each request continues the one before by previous_response_id): its
    instructions as the system message, then each request's input items and each response's
    output items as the messages kvchat stores them; its function tools in the Chat shape."""
    body = exchanges[-1].body
    if exchanges[-1].path.endswith("/chat/completions"):
        tools = None if body.get("tool_choice") == "none" else body.get("tools")
        return Conversation(list(body["messages"]), tools or None)
    instructions = body.get("instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for i, exchange in enumerate(exchanges):
        if i:
            previous = terminal_response(sse_events(exchanges[i - 1].lines))
            if previous is None or exchange.body.get("previous_response_id") != previous["id"]:
                raise ValueError(f"request {i + 1} does not continue the response before it")
            messages += item_messages(previous["output"])
        given = exchange.body["input"]
        messages += item_messages(
            [{"role": "user", "content": given}] if isinstance(given, str) else given
        )
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in body.get("tools") or ()
        if t["type"] == "function"
    ]
    return Conversation(messages, tools if tools and body.get("tool_choice") != "none" else None)


def item_messages(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Responses items as Chat Completions messages, as kvchat stores them: consecutive
    function calls (and the assistant message right before them) are one assistant message."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": item_text(item["content"])})
        elif kind == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*(out[-1].get("tool_calls") or ()), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            text = item_text(item["output"])
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise ValueError(f"an item of type {kind!r}: not one an agent's step renders here")
    return out


def item_text(content: str | Sequence[Mapping[str, Any]]) -> str:
    """A content string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or p.get("refusal") or "" for p in content)


# -- recording the wire ----------------------------------------------------------------------------


@dataclass
class Exchange:
    """One request as the recording transport saw it."""

    path: str
    body: dict[str, Any]
    request_bytes: int
    status: int = 0
    lines: list[str] = field(default_factory=list)
    ttft_ms: float | None = None
    latency_ms: float | None = None
    counters: Counters | None = None  # their growth while it ran

    def step(self) -> Step | None:
        """Its step, or None when it failed (no usage came back)."""
        if self.status != 200:
            return None
        read = chat_step if self.path.endswith("/chat/completions") else responses_step
        step = read(sse_events(self.lines))
        if step is None:
            return None
        return Step(
            step.prompt_tokens,
            step.cached_tokens,
            step.completion_tokens,
            step.calls,
            self.counters,
            self.ttft_ms,
            self.latency_ms,
            self.request_bytes,
        )


class _Tap(httpx2.AsyncByteStream):
    """A response stream passed on as it is, its SSE lines kept and timed. (No I/O of its own:
    a consumer may stop iterating it at any await.)"""

    def __init__(self, inner: httpx2.AsyncByteStream, exchange: Exchange, started: float) -> None:
        self.inner, self.exchange, self.started = inner, exchange, started

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pending = b""
        async for chunk in self.inner:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode().rstrip("\r")
                self.exchange.lines.append(line)
                if (
                    self.exchange.ttft_ms is None
                    and line.startswith("data: {")
                    and is_generated(json.loads(line[len("data: ") :]))
                ):
                    self.exchange.ttft_ms = (time.perf_counter() - self.started) * 1e3
            yield chunk
        self.exchange.lines.append(pending.decode())
        self.exchange.latency_ms = (time.perf_counter() - self.started) * 1e3

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recorder(httpx2.AsyncBaseTransport):
    """The OpenAI client's transport: every request and its streamed reply recorded, with what
    the server's counters (`counter` reads them) grew by while it ran: read before each request,
    a request's growth is up to the next request's reading (or `settle`'s, after the last).
    Exact only while one request runs at a time and nothing else uses the server, as in the
    bench's runs (the tools between two requests run in the client)."""

    def __init__(
        self,
        counter: Callable[[], Awaitable[Counters]],
        inner: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        self.inner = inner if inner is not None else httpx2.AsyncHTTPTransport()
        self.counter = counter
        self.exchanges: list[Exchange] = []
        self._before: list[Counters] = []  # the counters as each exchange started

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        content = await request.aread()
        exchange = Exchange(request.url.path, json.loads(content), len(content))
        self._before.append(await self.counter())
        self.exchanges.append(exchange)
        started = time.perf_counter()
        response = await self.inner.handle_async_request(request)
        exchange.status = response.status_code
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_Tap(response.stream, exchange, started),
            extensions=response.extensions,
        )

    async def settle(self) -> None:
        """Give every exchange so far its counters' growth (call once its replies are in)."""
        now = await self.counter()
        after = [*self._before[1:], now]
        for exchange, before, end in zip(self.exchanges, self._before, after, strict=True):
            if exchange.counters is None:
                exchange.counters = end - before

    async def aclose(self) -> None:
        await self.inner.aclose()
