"""Retention: which idle session's KV stays where, decided by when its next turn will come.

Three modes, so each is measured against the others (bench/retention.py):

- ``lru``: no session keeps KV past its turn, as vLLM's prefix cache: a finished turn's blocks
  go back to the pool, their full blocks findable by hash until reused (least recently used
  first), the last partial block lost.
- ``pinned``: each session keeps its KV pinned between turns; under pressure the least
  recently used idle session moves to the host pool, then is dropped.
- ``predictive``: each idle session's KV is worth the prefill time it saves, times the
  probability that its next turn comes soon, per byte it holds. The lowest value moves down a
  tier first (device -> host -> the KV store on disk -> nowhere); a session predicted to
  return soon, or whose user is typing, is brought back up ahead of its turn.

The probability comes from the session's signals (`Signals`): how its last turn ended (an
agent whose reply ended in tool calls comes back in about a second; a person reading a reply
in minutes, or never), the gaps between its turns (a log-normal learned online, per session
once it has a history, else per owner and class, else the class prior), its client's hint
(`prompt_cache_retention`, a conversation's `retention_ttl`), its operator's priority, and its
WebSocket's presence and typing. Holds are soft: a session ending in tool calls, one whose
user is typing, and one inside its client's TTL are held (their value counts many times
over), but under pressure a hold is broken rather than a running request stalled, lowest
value first, and counted. The budgets (max_kv_tokens) cap what any one session holds.

Everything here is plain Python over floats: the clock is injected, so tests drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import RetentionConfig

AGENT = "agent"  # its last turn ended in tool calls: its client comes back with the results
PERSON = "person"  # its last turn ended otherwise: a person reads the reply
CLASSES = (AGENT, PERSON)

# How a turn ended, as the service reports it.
TURN_ENDS = ("tool_calls", "stop", "length", "cancelled")

# Measured reload costs: how far each prefill step moves the per-token average, and how many
# bytes copied from a tier it takes before their rate replaces the configured one.
RATE_WEIGHT = 0.1
MIN_MEASURED_BYTES = 4 * 1024**2

# The tiers a session's KV lives in, top first.
DEVICE, HOST, DISK, NOWHERE = "device", "host", "disk", "none"
TIERS = (DEVICE, HOST, DISK, NOWHERE)


@dataclass(frozen=True)
class GapPrior:
    """A class's gaps between turns before anything is learned: a log-normal (its median and
    the sigma of the log), and the probability that a next turn comes at all."""

    median_s: float
    sigma: float
    p_return: float


# An agent's next request comes within seconds (a coding-agent trace: 86.5% within 1 s, 95.1%
# within 10 s); a person's in minutes when at all (a production chat trace: p25 69 s, p50
# 126 s, p95 621 s, log sigma 0.97).
AGENT_PRIOR = GapPrior(median_s=0.6, sigma=1.4, p_return=0.95)
PERSON_PRIOR = GapPrior(median_s=126.0, sigma=0.97, p_return=0.5)
PRIORS = {AGENT: AGENT_PRIOR, PERSON: PERSON_PRIOR}


@dataclass
class LogGaps:
    """Gaps between turns, online: how many, and the mean and spread of their logs (Welford);
    and how many turns ended, and how many of those the session came back after."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    ends: int = 0
    returns: int = 0

    def observe(self, gap_s: float) -> None:
        x = math.log(max(gap_s, 1e-3))
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)

    def blended(self, prior_mu: float, prior_sigma: float, weight: float) -> tuple[float, float]:
        """(mu, sigma) of the log gap: these observations blended with a prior that counts
        `weight` observations."""
        n = self.count
        if n == 0:
            return prior_mu, prior_sigma
        mu = (weight * prior_mu + n * self.mean) / (weight + n)
        spread = (
            self.m2
            + weight * prior_sigma**2
            + (weight * n / (weight + n)) * (self.mean - prior_mu) ** 2
        )
        sigma = math.sqrt(spread / (weight + n))
        return mu, max(sigma, 0.05)

    def p_return(self, prior: float, weight: float) -> float:
        return (prior * weight + self.returns) / (weight + self.ends)


@dataclass
class Signals:
    """What the service knows of one session's next turn."""

    owner: str | None = None
    end: str | None = None  # how its last turn ended (TURN_ENDS); None before any
    ended_at: float | None = None
    gaps: LogGaps = field(default_factory=LogGaps)
    ttl_s: float | None = None  # its client's or operator's retention, from each turn's end
    priority: int = 50  # an operator's rank, 0-100
    present: bool = False  # its WebSocket is open
    typing_at: float | None = None

    @property
    def klass(self) -> str:
        return AGENT if self.end == "tool_calls" else PERSON


@dataclass(frozen=True)
class Prediction:
    """What the policy makes of a session at one moment (for operators and the bench)."""

    klass: str
    p_return: float  # of a next turn within the tier's horizon
    next_turn_s: float | None  # the median wait for it from now, None if unlikely ever
    value: float  # seconds of prefill saved, expected, per byte, at its tier (held: weighted)
    held: bool


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


class RetentionPolicy:
    """The predictive policy's arithmetic, and what it learns across sessions (per owner and
    class). State of sessions lives in their Signals; this holds only the pooled gaps."""

    def __init__(self, config: RetentionConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._pooled: dict[tuple[str | None, str], LogGaps] = {}
        # What reloading costs, as the engine measures it.
        self.prefill_s_per_token = config.prefill_s_per_token
        self.host_bytes_per_s = config.host_bytes_per_s
        self.disk_bytes_per_s = config.disk_bytes_per_s

    # -- signals ------------------------------------------------------------------------------

    def turn_ended(self, signals: Signals, end: str, now: float) -> None:
        """A turn of the session ended (`end`: TURN_ENDS); a later report of the same turn (the
        service's, which knows of tool calls) replaces the engine's."""
        if signals.ended_at is None or signals.end is None or now - signals.ended_at > 1.0:
            self._pool(signals).ends += 1
            signals.gaps.ends += 1
        signals.end, signals.ended_at = end, now

    def turn_began(self, signals: Signals, now: float) -> None:
        """The session's next turn arrived: its gap is learned, and its user is no longer
        typing (the message they typed is this turn)."""
        signals.typing_at = None
        if signals.ended_at is None:
            return
        gap = max(now - signals.ended_at, 0.0)
        for gaps in (signals.gaps, self._pool(signals)):
            gaps.observe(gap)
            gaps.returns += 1

    def _pool(self, signals: Signals) -> LogGaps:
        return self._pooled.setdefault((signals.owner, signals.klass), LogGaps())

    # -- the model ----------------------------------------------------------------------------

    def gap_model(self, signals: Signals) -> tuple[float, float, float]:
        """(mu, sigma, p_return) of the session's next gap: the class prior, blended with its
        owner's gaps of that class, blended with its own (once it has two or more)."""
        prior = PRIORS[signals.klass]
        weight = self.config.prior_weight
        mu, sigma = math.log(prior.median_s), prior.sigma
        pooled = self._pooled.get((signals.owner, signals.klass))
        p_return = prior.p_return
        if pooled is not None:
            mu, sigma = pooled.blended(mu, sigma, weight)
            p_return = pooled.p_return(p_return, weight)
        if signals.gaps.count >= 2:  # its own gaps, against what its owner's say
            mu, sigma = signals.gaps.blended(mu, sigma, weight / 2)
            p_return = signals.gaps.p_return(p_return, weight / 2)
        if signals.present:  # its user has the page open
            p_return = max(p_return, 0.9)
        return mu, sigma, min(max(p_return, 0.0), 1.0)

    def p_return_within(self, signals: Signals, horizon_s: float, now: float) -> float:
        """The probability that the session's next turn comes within `horizon_s` from `now`,
        given that it has not come yet."""
        if signals.ended_at is None:
            return 0.0
        if self.typing(signals, now):
            return 1.0
        mu, sigma, p_return = self.gap_model(signals)
        elapsed = max(now - signals.ended_at, 0.0)

        def cdf(t: float) -> float:
            return _normal_cdf((math.log(t) - mu) / sigma) if t > 0 else 0.0

        done = p_return * cdf(elapsed)
        if done >= 1.0:
            return 0.0
        return p_return * (cdf(elapsed + horizon_s) - cdf(elapsed)) / (1.0 - done)

    def next_turn_s(self, signals: Signals, now: float) -> float | None:
        """The median wait from `now` for the next turn, given it has not come; None when it is
        more likely never to come."""
        if signals.ended_at is None:
            return None
        if self.typing(signals, now):
            return 0.0
        mu, sigma, p_return = self.gap_model(signals)
        elapsed = max(now - signals.ended_at, 0.0)
        done = p_return * (_normal_cdf((math.log(elapsed) - mu) / sigma) if elapsed > 0 else 0.0)
        # Solve p_return * F(elapsed + w) = done + (1 - done) / 2 for w.
        target = (done + (1.0 - done) / 2.0) / p_return if p_return > 0 else 2.0
        if target >= 1.0:
            return None
        z = _normal_quantile(target)
        return max(math.exp(mu + sigma * z) - elapsed, 0.0)

    def typing(self, signals: Signals, now: float) -> bool:
        return signals.typing_at is not None and now - signals.typing_at < self.config.typing_hold_s

    def held(self, signals: Signals, now: float) -> bool:
        """Whether the session is held: it ended in tool calls moments ago, its user is typing,
        or it is inside its client's TTL."""
        if self.typing(signals, now):
            return True
        if signals.ended_at is None:
            return False
        elapsed = now - signals.ended_at
        if signals.end == "tool_calls" and elapsed < self.config.agent_hold_s:
            return True
        return signals.ttl_s is not None and elapsed < signals.ttl_s

    # -- what reloading costs ----------------------------------------------------------------------

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        """A prefill step's time over its tokens: the per-token recompute cost, a moving
        average (its prompts' lengths and the machine's load move it)."""
        if num_tokens > 0 and seconds > 0:
            rate = seconds / num_tokens
            self.prefill_s_per_token += RATE_WEIGHT * (rate - self.prefill_s_per_token)

    def observe_copies(
        self, host_bytes: int, host_s: float, disk_bytes: int, disk_s: float
    ) -> None:
        """The bytes brought onto the device from host and from the KV store so far, and the
        seconds it took: their rates, once there are MIN_MEASURED_BYTES of each."""
        if host_bytes >= MIN_MEASURED_BYTES and host_s > 0:
            self.host_bytes_per_s = host_bytes / host_s
        if disk_bytes >= MIN_MEASURED_BYTES and disk_s > 0:
            self.disk_bytes_per_s = disk_bytes / disk_s

    # -- value ----------------------------------------------------------------------------------

    def reload_s(self, tier: str, num_tokens: int, num_bytes: int) -> float:
        """Seconds to have the KV back on the device from `tier`."""
        if tier == DEVICE:
            return 0.0
        if tier == HOST:
            return num_bytes / self.host_bytes_per_s
        if tier == DISK:
            return num_bytes / self.disk_bytes_per_s
        return num_tokens * self.prefill_s_per_token

    def value(
        self,
        signals: Signals,
        tier: str,
        below: str,
        num_tokens: int,
        num_bytes: int,
        now: float,
    ) -> float:
        """The expected prefill seconds keeping the session's KV at `tier` saves, per byte,
        against moving it to `below`; a held session's counts hold_weight times over, and an
        operator's priority scales it (x2 every 10 points above 50)."""
        if num_bytes <= 0:
            return 0.0
        horizon = self.config.horizon_s[min(TIERS.index(tier), 2)]
        p = self.p_return_within(signals, horizon, now)
        saved = self.reload_s(below, num_tokens, num_bytes) - self.reload_s(
            tier, num_tokens, num_bytes
        )
        value = p * max(saved, 0.0) / num_bytes
        value *= 2.0 ** ((signals.priority - 50) / 10.0)
        if self.held(signals, now):
            value = value * self.config.hold_weight + 1e-12
        return value

    def predict(
        self, signals: Signals, tier: str, below: str, num_tokens: int, num_bytes: int
    ) -> Prediction:
        now = self.clock()
        horizon = self.config.horizon_s[min(TIERS.index(tier), 2)]
        return Prediction(
            klass=signals.klass,
            p_return=self.p_return_within(signals, horizon, now),
            next_turn_s=self.next_turn_s(signals, now),
            value=self.value(signals, tier, below, num_tokens, num_bytes, now),
            held=self.held(signals, now),
        )

    def wants_prefetch(self, signals: Signals, now: float) -> bool:
        """Whether a session not on the device should be brought up now."""
        if self.typing(signals, now):
            return True
        p = self.p_return_within(signals, self.config.prefetch_horizon_s, now)
        return p >= self.config.prefetch_probability


def _normal_quantile(p: float) -> float:
    """The standard normal's quantile (Acklam's rational approximation, |error| < 1.2e-9)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    a = (-39.69683028665376, 220.9460984245205, -275.9285104469687, 138.3577518672690,
         -30.66479806614716, 2.506628277459239)  # fmt: skip
    b = (-54.47609879822406, 161.5858368580409, -155.6989798598866, 66.80131188771972,
         -13.28068155288572)  # fmt: skip
    c = (-7.784894002430293e-03, -0.3223964580411365, -2.400758277161838, -2.549732539343734,
         4.374664141464968, 2.938163982698783)  # fmt: skip
    d = (7.784695709041462e-03, 0.3224671290700398, 2.445134137142996, 3.754408661907416)
    low = 0.02425
    if p < low:
        q = math.sqrt(-2 * math.log(p))
        num = ((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]
        return num / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - low:
        return -_normal_quantile(1 - p)
    q = p - 0.5
    r = q * q
    num = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q
    return num / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
