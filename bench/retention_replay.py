"""bench/retention.py's replay against a started `kvchat serve`: a Plan's agents (tool loops over
the conversations API: a user task, then tool results as tool messages, tool_choice required
for the calls and auto for the last step, which answers) and people (turns over the
conversation's WebSocket, a typing frame before each message when asked), each at its planned
time, every request recorded; /metrics read before and after. And the two probes: a typing
person whose session was pushed to disk, against one whose KV stayed on the device; a keyless
client (`prompt_cache_key`, `prompt_cache_retention: "24h"`) whose server restarts between two
turns."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from kvchat.bench.retention_plan import (
    AGENT,
    PERSON,
    AgentPlan,
    PersonPlan,
    Plan,
    TurnRecord,
    ideal_tokens,
    words,
)

# Three tools of a coding agent; short arguments keep a call's decode at ~30 tokens.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "maxLength": 16}},
                "required": [arg],
                "additionalProperties": False,
            },
        },
    }
    for name, description, arg in (
        ("search", "Search the repository's files for a phrase.", "query"),
        ("read_file", "Read one file of the repository.", "path"),
        ("run_tests", "Run the tests under a path.", "path"),
    )
]


@dataclass(frozen=True)
class Endpoint:
    """A started server: its URL, the served model's name, an admin key and one key per
    class (each its own owner: the agents' and the chat page's)."""

    url: str
    model: str
    admin_key: str
    agent_key: str
    person_key: str

    def client(self, key: str, timeout: float = 900.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1)


# -- /metrics ------------------------------------------------------------------------------------


def scrape(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition, as `name{label=value,...}` -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return out


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def read_metrics(endpoint: Endpoint) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=endpoint.url, timeout=60) as c:
        return scrape((await c.get("/metrics")).raise_for_status().text)


# -- the replay ----------------------------------------------------------------------------------


@dataclass
class Replay:
    records: list[TurnRecord]
    metrics: dict[str, float]  # /metrics deltas over the run
    wall_s: float
    typing: str  # sent | off | unsupported (the server answers the frame with unknown_type)
    live_tokens: list[int]  # the live sessions' KV (tokens, as the replies' usage says), per s
    answers_in_text: int  # agents' last steps that answered in text (not with another call)
    shared_prefix: dict[str, int]  # tokens every first turn of a class shares (system, tools)
    errors: list[str] = field(default_factory=list)


async def shared_prefix(endpoint: Endpoint, system: str, tools: list[dict[str, Any]] | None) -> int:
    """Tokens every session of a class opens with: the common prefix of two first prompts
    (the system prompt, the tools, the user turn's header), by the server's tokenizer."""
    ids = []
    async with endpoint.client(endpoint.admin_key) as c:
        for text in ("alpha", "omega beta"):
            body: dict[str, Any] = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text},
                ],
                "return_token_ids": True,
            }
            if tools:
                body["tools"] = tools
            ids.append(
                (await c.post("/v1/tokenize", json=body)).raise_for_status().json()["token_ids"]
            )
    n = 0
    while n < min(map(len, ids)) and ids[0][n] == ids[1][n]:
        n += 1
    return n


async def typing_supported(endpoint: Endpoint, system: str) -> bool:
    """Whether the server takes a `typing` frame: one sent and a ping after it on a throwaway
    conversation; an error frame first means it does not."""
    async with endpoint.client(endpoint.person_key) as c:
        conv = (await c.post("/v1/conversations", json={"system": system})).raise_for_status()
    headers = {"Authorization": f"Bearer {endpoint.person_key}"}
    url = f"{endpoint.ws_url}/v1/conversations/{conv.json()['id']}/ws"
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "typing"}))
        await ws.send(json.dumps({"type": "ping"}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
    return bool(frame.get("type") == "pong")


async def session_tier(admin: httpx.AsyncClient, session_id: str) -> str:
    """Where the session's KV is now (device, host, disk, none), as GET /v1/admin/sessions/{id}
    says; `unknown` when it does not answer."""
    r = await admin.get(f"/v1/admin/sessions/{session_id}")
    if r.status_code != 200:
        return "unknown"
    engine = r.json().get("engine") or {}
    if engine.get("tier") in ("device", "host", "disk", "none"):
        return str(engine["tier"])
    state = engine.get("state")
    return {"resident": "device", "active": "device", "offloaded": "host", "stored": "disk"}.get(
        str(state), "none"
    )


class Replayer:
    """One run of a Plan against one server."""

    def __init__(self, endpoint: Endpoint, plan: Plan, *, typing: bool, bar: tqdm) -> None:
        self.endpoint = endpoint
        self.plan = plan
        self.config = plan.config
        self.typing = typing
        self.bar = bar
        self.records: list[TurnRecord] = []
        self.errors: list[str] = []
        self.held: dict[tuple[str, int], int] = {}  # live sessions' tokens (usage)
        self.answers_in_text = 0
        self.shared: dict[str, int] = {}
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))

    async def run(self, time_limit_s: float) -> Replay:
        endpoint, plan = self.endpoint, self.plan
        self.shared = {
            AGENT: await shared_prefix(endpoint, plan.agent_system, TOOLS),
            PERSON: await shared_prefix(endpoint, plan.person_system, None),
        }
        typing = "off"
        if self.typing:
            typing = (
                "sent" if await typing_supported(endpoint, plan.person_system) else "unsupported"
            )
        self.typing = typing == "sent"
        before = await read_metrics(endpoint)
        live: list[int] = []
        async with (
            endpoint.client(endpoint.agent_key) as agents,
            endpoint.client(endpoint.person_key) as people,
            endpoint.client(endpoint.admin_key, timeout=60) as admin,
        ):
            self.t0 = time.perf_counter()

            async def sample() -> None:
                while True:
                    live.append(sum(self.held.values()))
                    await asyncio.sleep(1.0)

            sampler = asyncio.create_task(sample())
            tasks = [self.agent(agents, admin, a) for a in plan.agents]
            tasks += [self.person(people, admin, p) for p in plan.people]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks), time_limit_s)
            wall = self.now()
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        for record in self.records:
            if record.total_s is None and record.error is None:
                record.error = "cut off at the time limit"
        after = await read_metrics(endpoint)
        return Replay(
            self.records,
            deltas(before, after),
            wall,
            typing,
            live,
            self.answers_in_text,
            self.shared,
            self.errors,
        )

    def begin(self, klass: str, session: int, turn: int) -> TurnRecord:
        record = TurnRecord(klass, session, turn, sent_at=self.now())
        self.records.append(record)
        return record

    def finish(
        self,
        record: TurnRecord,
        usage: dict[str, Any],
        timings: dict[str, Any],
        previous: tuple[int, int] | None,
    ) -> tuple[int, int]:
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.completion_tokens = int(usage.get("completion_tokens") or 0)
        record.cached_tokens = int(usage.get("cached_tokens") or 0)
        if timings.get("ttft_ms") is not None:
            record.ttft_s = float(timings["ttft_ms"]) / 1e3
        if timings.get("total_ms") is not None:
            record.total_s = float(timings["total_ms"]) / 1e3
        record.ideal = ideal_tokens(record.prompt_tokens, previous, self.shared[record.klass])
        self.held[(record.klass, record.session)] = record.prompt_tokens + record.completion_tokens
        self.bar.update(1)
        return record.prompt_tokens, record.completion_tokens

    # -- an agent ----------------------------------------------------------------------------

    async def agent(
        self, client: httpx.AsyncClient, admin: httpx.AsyncClient, plan: AgentPlan
    ) -> None:
        config = self.config
        await self.sleep_until(plan.arrival_s)
        try:
            conv = (
                (await client.post("/v1/conversations", json={"system": self.plan.agent_system}))
                .raise_for_status()
                .json()["id"]
            )
            message: dict[str, Any] = {"role": "user", "content": plan.task}
            previous: tuple[int, int] | None = None
            for k in range(plan.num_requests):
                last = k == len(plan.steps)
                record = self.begin(AGENT, plan.index, k + 1)
                if k > 0:
                    record.gap_s = plan.steps[k - 1].latency_s
                    record.tier_before = await session_tier(admin, conv)
                    record.sent_at = self.now()
                body = {
                    **message,
                    "tools": TOOLS,
                    "tool_choice": "auto" if last else "required",
                    "parallel_tool_calls": False,
                    "max_tokens": config.answer_tokens if last else config.call_tokens,
                    "temperature": 0,
                }
                r = await client.post(f"/v1/conversations/{conv}/messages", json=body)
                if r.status_code != 200:
                    record.error = f"HTTP {r.status_code}: {r.text[:200]}"
                    self.bar.update(1)
                    return
                reply = r.json()
                record.finish_reason = reply.get("finish_reason")
                previous = self.finish(
                    record, reply.get("usage") or {}, reply.get("timings") or {}, previous
                )
                calls = reply.get("tool_calls") or []
                if last:
                    self.answers_in_text += not calls
                    break
                step = plan.steps[k]
                if calls:  # the tool's result, as its tool message
                    message = {
                        "role": "tool",
                        "tool_call_id": calls[0]["id"],
                        "content": step.result,
                    }
                else:  # no call came (cut at max_tokens): the result goes back as the user's
                    message = {"role": "user", "content": step.result}
                await asyncio.sleep(step.latency_s)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            self.errors.append(f"agent {plan.index}: {type(e).__name__}: {e}")
        finally:
            self.held.pop((AGENT, plan.index), None)

    # -- a person ----------------------------------------------------------------------------

    async def person(
        self, client: httpx.AsyncClient, admin: httpx.AsyncClient, plan: PersonPlan
    ) -> None:
        config = self.config
        await self.sleep_until(plan.arrival_s)
        headers = {"Authorization": f"Bearer {self.endpoint.person_key}"}
        try:
            conv = (
                (await client.post("/v1/conversations", json={"system": self.plan.person_system}))
                .raise_for_status()
                .json()["id"]
            )
            url = f"{self.endpoint.ws_url}/v1/conversations/{conv}/ws"
            async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
                previous: tuple[int, int] | None = None
                replied_at = self.now()
                for k, turn in enumerate(plan.turns):
                    typed_at = None
                    if k > 0 and self.typing:
                        await self.sleep_until(replied_at + turn.typing_at_s(config.typing_lead_s))
                        await ws.send(json.dumps({"type": "typing"}))
                        typed_at = self.now()
                    await self.sleep_until(replied_at + turn.think_s)
                    record = self.begin(PERSON, plan.index, k + 1)
                    if k > 0:
                        record.gap_s = turn.think_s
                        record.tier_before = await session_tier(admin, conv)
                        record.sent_at = self.now()
                    if typed_at is not None:
                        record.typed_s = record.sent_at - typed_at
                    await ws.send(
                        json.dumps(
                            {
                                "type": "message",
                                "content": turn.text,
                                "max_tokens": config.reply_tokens,
                                "ignore_eos": True,
                                "temperature": 0,
                            }
                        )
                    )
                    done = await self.read_reply(ws, record)
                    if done is None:
                        self.bar.update(1)
                        return
                    record.finish_reason = done.get("finish_reason")
                    previous = self.finish(
                        record, done.get("usage") or {}, done.get("timings") or {}, previous
                    )
                    replied_at = self.now()
        except (httpx.HTTPError, websockets.WebSocketException, OSError, KeyError) as e:
            self.errors.append(f"person {plan.index}: {type(e).__name__}: {e}")
        finally:
            self.held.pop((PERSON, plan.index), None)

    async def read_reply(
        self, ws: websockets.ClientConnection, record: TurnRecord
    ) -> dict[str, Any] | None:
        """Frames until the reply's done (returned) or an error (recorded: None)."""
        while True:
            frame = json.loads(await ws.recv())
            kind = frame.get("type")
            if kind in ("delta", "tool_call") and record.client_ttft_s is None:
                record.client_ttft_s = self.now() - record.sent_at
            elif kind == "done":
                return dict(frame)
            elif kind == "error":
                record.error = f"{frame.get('code')}: {frame.get('message')}"
                return None


# -- the probes ----------------------------------------------------------------------------------


async def ws_turn(
    endpoint: Endpoint,
    conv: str,
    text: str,
    max_tokens: int,
    *,
    typing_lead_s: float | None = None,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    """One turn over the conversation's WebSocket (a typing frame `typing_lead_s` before the
    message when given, else `pause_s` of silence after connecting): the done frame, with the
    client's TTFT added (`client_ttft_s`)."""
    headers = {"Authorization": f"Bearer {endpoint.person_key}"}
    url = f"{endpoint.ws_url}/v1/conversations/{conv}/ws"
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        if typing_lead_s is not None:
            await ws.send(json.dumps({"type": "typing"}))
            await asyncio.sleep(typing_lead_s)
        elif pause_s > 0:
            await asyncio.sleep(pause_s)
        sent = time.perf_counter()
        await ws.send(
            json.dumps(
                {
                    "type": "message",
                    "content": text,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                }
            )
        )
        first = None
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "delta" and first is None:
                first = time.perf_counter() - sent
            elif frame["type"] == "done":
                return {**frame, "client_ttft_s": first}
            elif frame["type"] == "error":
                raise RuntimeError(f"{frame.get('code')}: {frame.get('message')}")


async def store_settled(endpoint: Endpoint, timeout_s: float = 60.0) -> None:
    """Until the KV store has written what was queued (GET /v1/admin/memory's pending bytes)."""
    async with endpoint.client(endpoint.admin_key, timeout=60) as admin:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            store = (await admin.get("/v1/admin/memory")).raise_for_status().json().get("kv_store")
            if not store or not store.get("pending_bytes"):
                return
            await asyncio.sleep(0.2)


@dataclass(frozen=True)
class TypingProbe:
    """Server TTFT (s) of a later turn, per repeat: the session pushed to disk and its user
    typing `lead_s` before the message; its KV left on the device; pushed to disk, no typing."""

    lead_s: float
    context_tokens: int
    disk_typing: list[float]
    device: list[float]
    disk_silent: list[float]
    tiers_after_push: list[str]

    @property
    def ratio(self) -> float:
        return statistics.median(self.disk_typing) / statistics.median(self.device)


async def typing_probe(
    endpoint: Endpoint, plan: Plan, *, repeats: int, lead_s: float, document_words: int, bar: tqdm
) -> TypingProbe:
    """Three conversations with the same opening (a long first message), then `repeats` later
    turns each, in turn: one pushed to disk (POST /v1/admin/sessions/{id}/evict?offload=false)
    whose user types first, one left on the device, one pushed to disk without typing. Each
    message is sent `lead_s` after its socket opens, typed or not: an idle engine's first step
    is slower, and every variant waits as long."""
    import random

    rng = random.Random(plan.config.seed + 7)
    opening = "Please read this and keep it in mind:\n" + words(rng, document_words)
    async with (
        endpoint.client(endpoint.person_key) as people,
        endpoint.client(endpoint.admin_key, timeout=60) as admin,
    ):
        convs = []
        context = 0
        for _ in range(3):
            conv = (
                await people.post("/v1/conversations", json={"system": plan.person_system})
            ).raise_for_status()
            convs.append(conv.json()["id"])
            done = await ws_turn(endpoint, convs[-1], opening, plan.config.reply_tokens)
            context = done["usage"]["prompt_tokens"]
            bar.update(1)
        times: list[list[float]] = [[], [], []]
        tiers = []
        for r in range(repeats):
            await store_settled(endpoint)
            for i in (0, 2):
                (
                    await admin.post(
                        f"/v1/admin/sessions/{convs[i]}/evict", params={"offload": "false"}
                    )
                ).raise_for_status()
                tiers.append(await session_tier(admin, convs[i]))
            for i in (r % 3, (r + 1) % 3, (r + 2) % 3):  # the order rotates
                text = f"Question {r + 1}: " + words(rng, 20) + "?"
                done = await ws_turn(
                    endpoint,
                    convs[i],
                    text,
                    plan.config.reply_tokens,
                    typing_lead_s=lead_s if i == 0 else None,
                    # The others wait as long, silent: every turn finds the server idle as long.
                    pause_s=lead_s,
                )
                times[i].append(float(done["timings"]["ttft_ms"]) / 1e3)
                bar.update(1)
    return TypingProbe(lead_s, context, times[0], times[1], times[2], tiers)


@dataclass(frozen=True)
class RestartProbe:
    """A keyless client's two turns with a server restart between: the second prompt's tokens,
    those served from cache, and those the first turn had (its prompt and reply)."""

    first_prompt: int
    first_completion: int
    second_prompt: int
    second_cached: int
    metrics: dict[str, float]  # /metrics of the restarted server after the second turn

    @property
    def share(self) -> float:
        return self.second_cached / self.second_prompt if self.second_prompt else float("nan")

    @property
    def best_share(self) -> float:
        """What a cache holding all of the first turn could serve."""
        held = self.first_prompt + self.first_completion
        return (
            min(held, self.second_prompt) / self.second_prompt
            if self.second_prompt
            else float("nan")
        )


async def chat(
    endpoint: Endpoint, messages: list[dict[str, Any]], max_tokens: int, cache_key: str
) -> dict[str, Any]:
    async with endpoint.client(endpoint.person_key) as c:
        body = {
            "model": endpoint.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "prompt_cache_key": cache_key,
            "prompt_cache_retention": "24h",
        }
        return dict((await c.post("/v1/chat/completions", json=body)).raise_for_status().json())


async def restart_probe(
    endpoint: Endpoint,
    plan: Plan,
    restart: Callable[[], Awaitable[Endpoint]],
    *,
    document_words: int,
) -> RestartProbe:
    """Turn one (a long first message), the KV store settled, `restart()`, turn two (the
    history, the reply as the client got it, a short question): no X-Session-Id, only
    prompt_cache_key and prompt_cache_retention "24h"."""
    import random

    rng = random.Random(plan.config.seed + 11)
    key = f"retention-bench-{plan.config.seed}"
    messages = [
        {"role": "system", "content": plan.person_system},
        {"role": "user", "content": "Here is my text:\n" + words(rng, document_words)},
    ]
    first = await chat(endpoint, messages, plan.config.reply_tokens, key)
    await store_settled(endpoint)
    endpoint = await restart()
    messages.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
    messages.append(
        {"role": "user", "content": "Thanks. One more question: " + words(rng, 12) + "?"}
    )
    second = await chat(endpoint, messages, plan.config.reply_tokens, key)
    usage1, usage2 = first["usage"], second["usage"]
    return RestartProbe(
        usage1["prompt_tokens"],
        usage1["completion_tokens"],
        usage2["prompt_tokens"],
        int((usage2.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        await read_metrics(endpoint),
    )
