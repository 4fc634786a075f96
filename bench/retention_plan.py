"""bench/retention.py's pure parts: the seeded workload (agents' tool loops, people's turns
and think times, typing frames), the live sessions' KV over a nominal timeline and the pool
sizes it asks for, the ideal prompt-token arithmetic, per-class summaries and the goals.

Nothing here talks to a server: the replay (bench/retention_replay.py) sends what a Plan says,
and every policy's run replays the same Plan."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

AGENT, PERSON = "agent", "person"
CLASSES = (AGENT, PERSON)
PLURAL = {AGENT: "agents", PERSON: "people"}
POSSESSIVE = {AGENT: "agents'", PERSON: "people's"}

# Think times of people between turns: a public production chat trace's figures (p25 69 s,
# p50 126 s, p95 621 s), a log-normal with median 126 s and log sigma 0.97.
THINK_MEDIAN_S = 126.0
THINK_SIGMA = 0.97
RETURN_WINDOW_S = 5.0  # an agent's return within this is one the device should serve

WORDS = (
    "cache", "session", "turn", "prompt", "tokens", "block", "device", "host", "disk", "store",
    "agent", "tool", "call", "result", "reply", "person", "message", "think", "typing", "river",
    "mountain", "lantern", "copper", "violet", "harbor", "meadow", "signal", "quartz", "ember",
    "canyon", "orbit", "saddle", "timber", "walnut", "falcon", "glacier", "pepper", "marble",
    "the", "of", "and", "to", "in", "is", "for", "with", "on", "that", "what", "why", "how",
)  # fmt: skip


@dataclass(frozen=True)
class WorkloadConfig:
    """What the replay sends; times in bench seconds (people's think times already divided by
    `compression`; agents' tool latencies are real: seconds are what tools take).

    People arrive over the first `people_arrival_s` and keep talking for `duration_s`: each
    takes turns while its planned timeline (its think times, and `nominal_turn_s` per reply)
    stays inside it, so the people's sessions are live (another turn to come) through most of
    the run. Agent tasks arrive over the first `agents_arrival_s`."""

    seed: int = 0
    duration_s: float = 240.0
    nominal_turn_s: float = 3.0  # a request's time, for planning only
    num_agents: int = 6  # agent tasks, one session each
    agents_arrival_s: float = 180.0
    calls: tuple[int, int] = (3, 10)  # tool calls per task, before the answer
    tool_latency_s: tuple[float, float] = (0.2, 5.0)  # between a reply and its tool result
    result_words: tuple[int, int] = (30, 90)  # a tool result's length
    num_people: int = 20
    people_arrival_s: float = 20.0
    max_person_turns: int = 12
    message_words: tuple[int, int] = (12, 36)
    document_words: int = 500  # the text a person pastes into the first message
    system_words: int = 240  # each class's shared system prompt (about 300 tokens)
    compression: float = 4.0
    typing_lead_s: float = 2.0  # a typing frame this long (bench seconds) before each message
    reply_tokens: int = 24  # a person's reply (ignore_eos: every policy decodes as many)
    call_tokens: int = 64  # max tokens of a tool-call step
    answer_tokens: int = 32  # max tokens of an agent's answer

    def __post_init__(self) -> None:
        for name in ("calls", "tool_latency_s", "result_words", "message_words"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range (0 <= low <= high), got {low, high}")
        if self.calls[0] < 1 or self.max_person_turns < 1:
            raise ValueError("every task needs a call and every person a turn")
        if self.compression <= 0 or self.nominal_turn_s <= 0:
            raise ValueError("compression and nominal_turn_s must be > 0")
        if min(self.duration_s, self.agents_arrival_s, self.people_arrival_s) < 0:
            raise ValueError("durations must be >= 0")
        if self.typing_lead_s < 0 or self.num_agents < 0 or self.num_people < 0:
            raise ValueError("the typing lead and the numbers of agents and people must be >= 0")


@dataclass(frozen=True)
class AgentStep:
    """One tool call's round trip: the tool runs `latency_s` after the reply, then `result`
    goes back as the tool message."""

    latency_s: float
    result: str


@dataclass(frozen=True)
class AgentPlan:
    index: int
    arrival_s: float
    task: str
    steps: tuple[AgentStep, ...]  # one per tool call; then a last request that answers

    @property
    def num_requests(self) -> int:
        return len(self.steps) + 1


@dataclass(frozen=True)
class PersonTurn:
    think_s: float  # after the previous reply (bench seconds); 0 for the first turn
    text: str

    def typing_at_s(self, lead_s: float) -> float:
        """When, after the previous reply, its typing frame goes: `lead_s` before the message,
        or at once when the think time is shorter."""
        return max(0.0, self.think_s - lead_s)


@dataclass(frozen=True)
class PersonPlan:
    index: int
    arrival_s: float
    turns: tuple[PersonTurn, ...]

    @property
    def num_requests(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class Plan:
    config: WorkloadConfig
    agent_system: str
    person_system: str
    agents: tuple[AgentPlan, ...]
    people: tuple[PersonPlan, ...]

    @property
    def num_requests(self) -> int:
        return sum(a.num_requests for a in self.agents) + sum(p.num_requests for p in self.people)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def think_time_s(rng: random.Random, compression: float) -> float:
    """A person's think time (bench seconds): the trace's log-normal, compressed."""
    return math.exp(math.log(THINK_MEDIAN_S) + THINK_SIGMA * rng.gauss(0.0, 1.0)) / compression


def make_plan(config: WorkloadConfig) -> Plan:
    """The workload of `config.seed`: every draw from its own stream (agents, people), so a
    change to one class's settings leaves the other's plan as it was."""
    rng = random.Random(config.seed)
    agent_system = (
        "You are a coding agent working in a repository. Call one tool at a time; when you "
        "have what you need, answer the user briefly. Notes: " + words(rng, config.system_words)
    )
    person_system = (
        "You are a helpful assistant in a chat window. Answer clearly and briefly. Notes: "
        + words(rng, config.system_words)
    )
    arng = random.Random(config.seed * 1_000_003 + 1)
    arrivals = sorted(arng.uniform(0, config.agents_arrival_s) for _ in range(config.num_agents))
    agents = []
    for i, arrival in enumerate(arrivals):
        steps = tuple(
            AgentStep(
                latency_s=arng.uniform(*config.tool_latency_s),
                result=f"result {k + 1}: " + words(arng, arng.randint(*config.result_words)),
            )
            for k in range(arng.randint(*config.calls))
        )
        task = f"Task {i}: find where " + words(arng, 12) + " and fix it."
        agents.append(AgentPlan(i, arrival, task, steps))
    prng = random.Random(config.seed * 1_000_003 + 2)
    arrivals = sorted(prng.uniform(0, config.people_arrival_s) for _ in range(config.num_people))
    people = []
    for i, arrival in enumerate(arrivals):
        # Each person's think times and texts from streams of their own: a longer text or
        # another person leaves this one's timeline as it was.
        think_rng = random.Random(config.seed * 1_000_003 + 1_009 * (i + 1))
        text_rng = random.Random(config.seed * 1_000_003 + 1_013 * (i + 1) + 1)
        turns = []
        t = arrival + config.nominal_turn_s  # when the first reply is in, nominally
        for k in range(config.max_person_turns):
            think = 0.0 if k == 0 else think_time_s(think_rng, config.compression)
            if k > 0:
                t += think + config.nominal_turn_s
                if t > config.duration_s:
                    break
            text = f"Person {i}, message {k + 1}: " + words(
                text_rng, text_rng.randint(*config.message_words)
            )
            if k == 0 and config.document_words:
                text += "\nHere is my text:\n" + words(text_rng, config.document_words)
            turns.append(PersonTurn(think, text))
        people.append(PersonPlan(i, arrival, tuple(turns)))
    return Plan(config, agent_system, person_system, tuple(agents), tuple(people))


# -- the live sessions' KV and the pools --------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A session's requests on a nominal timeline: each (start, tokens held from then on)."""

    klass: str
    starts: tuple[float, ...]
    tokens: tuple[int, ...]
    end: float

    def held_at(self, t: float) -> int:
        """Tokens of KV the session needs at `t` (0 before its first request or after its
        last ended: a live session is one with a turn to come or running)."""
        if not self.starts or t < self.starts[0] or t >= self.end:
            return 0
        held = 0
        for start, tokens in zip(self.starts, self.tokens, strict=True):
            if start > t:
                break
            held = tokens
        return held


def nominal_spans(
    plan: Plan,
    count: Callable[[str], int],
    service_s: float,
    *,
    message_overhead: int = 5,
) -> list[Span]:
    """Each session's requests if every request took `service_s`: when it starts and the
    tokens its session holds once it has run (prompt + reply); `count` counts a text's tokens
    (the model's tokenizer; `message_overhead` tokens of template per message)."""
    config = plan.config
    spans = []
    for agent in plan.agents:
        held = count(plan.agent_system) + count(agent.task) + 2 * message_overhead
        t = agent.arrival_s
        starts, tokens = [], []
        for step in agent.steps:
            held += config.call_tokens // 2 + message_overhead
            starts.append(t)
            tokens.append(held)
            t += service_s + step.latency_s
            held += count(step.result) + message_overhead
        held += config.answer_tokens
        starts.append(t)
        tokens.append(held)
        spans.append(Span(AGENT, tuple(starts), tuple(tokens), t + service_s))
    for person in plan.people:
        held = count(plan.person_system) + message_overhead
        t = person.arrival_s
        starts, tokens = [], []
        for turn in person.turns:
            t += turn.think_s
            held += count(turn.text) + config.reply_tokens + 2 * message_overhead
            starts.append(t)
            tokens.append(held)
            t += service_s
        spans.append(Span(PERSON, tuple(starts), tuple(tokens), t))
    return spans


def live_tokens(spans: Sequence[Span], step_s: float = 1.0) -> list[int]:
    """The KV tokens the live sessions need, every `step_s` over the busy span."""
    if not spans:
        return []
    begin = min(s.starts[0] for s in spans if s.starts)
    end = max(s.end for s in spans)
    n = max(1, math.ceil((end - begin) / step_s))
    return [sum(s.held_at(begin + i * step_s) for s in spans) for i in range(n)]


@dataclass(frozen=True)
class PoolSizes:
    """The device pool and the host pool (bytes, whole blocks), and the live sessions' KV they
    were sized for (tokens: the mean over the busy span, and the peak)."""

    device_bytes: int
    host_bytes: int
    bytes_per_token: int
    live_mean_tokens: float
    live_peak_tokens: int

    @property
    def pressure(self) -> float:
        """The live sessions' KV (mean) over what the device and the host hold."""
        return self.live_mean_tokens * self.bytes_per_token / (self.device_bytes + self.host_bytes)


def size_pools(
    live: Sequence[int],
    running_tokens: int,
    *,
    bytes_per_token: int,
    block_size: int,
    pressure: float,
    host_share: float,
) -> PoolSizes:
    """Device + host = the live sessions' mean KV (`live`, tokens over time) / `pressure`,
    `host_share` of it on the host; but the device holds at least `running_tokens` (the
    requests running at once must fit, or every policy only queues) and the host at least
    half of that (a session or two). Whole blocks."""
    assert live and pressure > 0 and 0 <= host_share < 1
    mean = sum(live) / len(live)
    block_bytes = block_size * bytes_per_token

    def blocks(tokens: float) -> int:
        return max(1, math.ceil(tokens / block_size)) * block_bytes

    total = mean / pressure
    device = max(total * (1 - host_share), float(running_tokens))
    host = max(total - device, running_tokens / 2)
    return PoolSizes(blocks(device), blocks(host), bytes_per_token, mean, max(live))


def running_tokens(spans: Sequence[Span], concurrent: int = 2, q: float = 0.9) -> int:
    """The KV `concurrent` requests of long sessions need at once: that many times the `q`
    quantile of the sessions' last requests."""
    return concurrent * round(quantile([s.tokens[-1] for s in spans if s.tokens], q))


def kv_bytes_per_token(model_config: dict[str, object], dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element, from a HF config."""
    layers = int(str(model_config["num_hidden_layers"]))
    heads = int(str(model_config.get("num_key_value_heads", model_config["num_attention_heads"])))
    head_dim = model_config.get("head_dim")
    if head_dim is None:
        head_dim = int(str(model_config["hidden_size"])) // int(
            str(model_config["num_attention_heads"])
        )
    return 2 * layers * heads * int(str(head_dim)) * dtype_bytes


# -- what a turn cost, against the ideal ---------------------------------------------------------


def ideal_tokens(prompt_tokens: int, previous: tuple[int, int] | None, shared_prefix: int) -> int:
    """The prompt tokens a perfect cache computes: those no earlier turn of the session had.
    A later turn: its prompt less the previous turn's prompt and reply (`previous`: prompt and
    completion tokens; what follows, the reply's end of turn, the new message and the
    generation prompt, is new). A first turn: its prompt less the shared prefix (the system
    prompt and tools every session of its class opens with, computed once)."""
    if previous is None:
        return max(prompt_tokens - shared_prefix, 0)
    return max(prompt_tokens - previous[0] - previous[1], 0)


@dataclass
class TurnRecord:
    """One request as the replay saw it (times in seconds; the server's TTFT: from the turn's
    start to its first generated token, as its message's timings say)."""

    klass: str
    session: int
    turn: int  # 1-based
    sent_at: float = 0.0  # since the run's start
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ideal: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    client_ttft_s: float | None = None  # people: the first delta frame, at the client
    gap_s: float | None = None  # the think time or tool latency before it
    tier_before: str | None = None  # where the session's KV was just before a later turn
    typed_s: float | None = None  # people: how long before the message its typing frame went
    finish_reason: str | None = None
    error: str | None = None

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def decode_tok_s(self) -> float | None:
        if self.ttft_s is None or self.total_s is None or self.completion_tokens < 2:
            return None
        after = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / after if after > 0 else None


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest rank (as bench/peers_serving.py); nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass(frozen=True)
class ClassSummary:
    klass: str
    turns: int
    failed: int
    prompt: int
    computed: int
    ideal: int
    ttft_p50_s: float
    ttft_p90_s: float
    decode_tok_s: float  # per request, p50
    later_ttft_p90_s: float = float("nan")  # turns after the first: where retention acts
    quick_returns: int = 0  # agents: returns within RETURN_WINDOW_S
    quick_on_device: int = 0  # of those, found on the device just before

    @property
    def computed_over_ideal(self) -> float:
        return self.computed / self.ideal if self.ideal else float("nan")

    @property
    def device_share(self) -> float:
        return self.quick_on_device / self.quick_returns if self.quick_returns else float("nan")


def summarize(records: Sequence[TurnRecord], klass: str | None) -> ClassSummary:
    """The class's turns (None: all of them)."""
    mine = [r for r in records if klass is None or r.klass == klass]
    ok = [r for r in mine if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    decode = [d for r in ok if (d := r.decode_tok_s) is not None]
    quick = [
        r
        for r in ok
        if r.klass == AGENT and r.gap_s is not None and r.gap_s <= RETURN_WINDOW_S and r.turn > 1
    ]
    return ClassSummary(
        klass=klass or "all",
        turns=len(mine),
        failed=len(mine) - len(ok),
        prompt=sum(r.prompt_tokens for r in ok),
        computed=sum(r.computed for r in ok),
        ideal=sum(r.ideal for r in ok),
        ttft_p50_s=quantile(ttft, 0.5),
        ttft_p90_s=quantile(ttft, 0.9),
        decode_tok_s=quantile(decode, 0.5),
        later_ttft_p90_s=quantile(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 1], 0.9
        ),
        quick_returns=len(quick),
        quick_on_device=sum(r.tier_before == "device" for r in quick),
    )


# -- goals ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """A measured figure against its target: `at_most` (<=) or not (>=); nan: not measured."""

    name: str
    measured: float
    target: float
    at_most: bool = True

    @property
    def met(self) -> bool | None:
        if math.isnan(self.measured):
            return None
        return self.measured <= self.target if self.at_most else self.measured >= self.target

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "**FAIL**", None: "not measured"}[self.met]

    @property
    def target_text(self) -> str:
        return ("<= " if self.at_most else ">= ") + f"{self.target:g}"


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


@dataclass(frozen=True)
class PolicyRun:
    """What the goals read of one policy's run of the mixed workload."""

    all: ClassSummary
    by_class: dict[str, ClassSummary] = field(default_factory=dict)


def mixed_goals(runs: dict[str, PolicyRun]) -> list[Goal]:
    """The issue's goals for the mixed workload under pressure: predictive against lru and
    pinned (a policy missing from `runs` leaves its goals not measured)."""
    nan = float("nan")
    pred, lru, pinned = runs.get("predictive"), runs.get("lru"), runs.get("pinned")

    def p90(run: PolicyRun | None) -> float:
        return run.all.ttft_p90_s if run is not None else nan

    goals = [
        Goal("TTFT p90, predictive / lru", ratio(p90(pred), p90(lru)), 0.5),
        Goal("TTFT p90, predictive / pinned", ratio(p90(pred), p90(pinned)), 0.7),
        Goal(
            "prompt tokens computed, predictive / lru",
            ratio(
                pred.all.computed if pred else nan,
                lru.all.computed if lru else nan,
            ),
            0.5,
        ),
    ]
    for klass in CLASSES:
        mine = pred.by_class.get(klass) if pred else None
        theirs = lru.by_class.get(klass) if lru else None
        goals.append(
            Goal(
                f"{POSSESSIVE[klass]} TTFT p50, predictive / lru",
                ratio(mine.ttft_p50_s if mine else nan, theirs.ttft_p50_s if theirs else nan),
                1.05,
            )
        )
    agents = pred.by_class.get(AGENT) if pred else None
    goals.append(
        Goal(
            f"agents returning within {RETURN_WINDOW_S:g} s served from the device (predictive)",
            agents.device_share if agents else nan,
            0.95,
            at_most=False,
        )
    )
    return goals
