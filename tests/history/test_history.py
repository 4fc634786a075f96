"""The history planner against a brute-force reading of its rules: random conversations
(users, assistants, tool-call groups of 1-3 results), budgets and policies, single plans and
simulated many-turn sessions, plus the boundaries one by one."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.history import (
    POLICIES,
    TOOL_CUT_MARKER,
    ContextLengthExceeded,
    ContextPlan,
    HistoryMessage,
    HistoryPolicy,
    HistoryPolicyError,
    InvalidHistoryError,
    SummaryState,
    merge_summary,
    plan_context,
    summarization_messages,
    summary_max_new_tokens,
    tool_cap_split,
    units,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIMULATIONS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- builders ---------------------------------------------------------------------------------


class Conversation:
    """Appends messages with fresh ids, as a stored branch grows."""

    def __init__(self) -> None:
        self.messages: list[HistoryMessage] = []
        self._calls = 0

    def _id(self) -> str:
        return f"m{len(self.messages)}"

    def user(self, num_tokens: int) -> None:
        self.messages.append(HistoryMessage(self._id(), "user", num_tokens, num_tokens))

    def assistant(self, num_tokens: int, num_calls: int = 0) -> list[str]:
        calls = [f"c{self._calls + k}" for k in range(num_calls)]
        self._calls += num_calls
        self.messages.append(
            HistoryMessage(self._id(), "assistant", num_tokens, num_tokens, tuple(calls))
        )
        return calls

    def tool(self, call_id: str, num_tokens: int, content_tokens: int) -> None:
        self.messages.append(
            HistoryMessage(self._id(), "tool", num_tokens, content_tokens, tool_call_id=call_id)
        )


sizes = st.integers(min_value=0, max_value=120)


@st.composite
def tool_result(draw: st.DrawFn) -> tuple[int, int]:
    """(num_tokens, content_tokens): sometimes far over any cap, to exercise it."""
    content = draw(st.one_of(st.integers(0, 80), st.integers(200, 600)))
    return content + draw(st.integers(0, 8)), content


@st.composite
def conversations(draw: st.DrawFn, max_units: int = 14) -> list[HistoryMessage]:
    """A branch of random units ending on a user or tool message (the newest message)."""
    conv = Conversation()
    if draw(st.booleans()) and draw(st.booleans()):
        conv.assistant(draw(sizes))  # a greeting before the first user message
    for _ in range(draw(st.integers(0, max_units))):
        kind = draw(st.sampled_from(["user", "user", "assistant", "tools"]))
        if kind == "user":
            conv.user(draw(sizes))
        elif kind == "assistant":
            conv.assistant(draw(sizes))
        else:
            calls = conv.assistant(draw(sizes), draw(st.integers(1, 3)))
            for call in calls[: draw(st.integers(1, len(calls)))]:
                conv.tool(call, *draw(tool_result()))
    if conv.messages and conv.messages[-1].role != "assistant":
        return conv.messages
    if draw(st.booleans()):
        conv.user(draw(sizes))
    else:  # an agent loop's turn: the newest message is a tool result
        calls = conv.assistant(draw(sizes), draw(st.integers(1, 3)))
        for call in calls[: draw(st.integers(1, len(calls)))]:
            conv.tool(call, *draw(tool_result()))
    return conv.messages


@st.composite
def policies(draw: st.DrawFn, names: Sequence[str] = POLICIES) -> HistoryPolicy:
    low, high = sorted(draw(st.integers(0, 20)) / 20 for _ in range(2))
    cap = draw(st.one_of(st.none(), st.integers(32, 300)))
    return HistoryPolicy(draw(st.sampled_from(names)), high, low, cap)


# -- the rules, read brute force ----------------------------------------------------------------


def prompt_size(m: HistoryMessage, cap: int | None) -> int:
    cut = cap is not None and m.role == "tool" and m.content_tokens > cap
    return m.num_tokens - m.content_tokens + cap if cut and cap is not None else m.num_tokens


def unit_of(messages: Sequence[HistoryMessage]) -> list[int]:
    """For each message, the index where its unit begins (tool results join their call)."""
    owner: list[int] = []
    for i, m in enumerate(messages):
        owner.append(owner[-1] if m.role == "tool" else i)
    return owner


@dataclass
class Reading:
    """What the rules say for one planning call."""

    messages: Sequence[HistoryMessage]
    policy: HistoryPolicy
    limit: int
    max_tokens: int
    starts: list[int]  # valid starts from the previous trim point on
    previous: int
    running: SummaryState | None  # the summary that applies to the branch, placed or not
    base: int  # system + generation prompt

    def messages_from(self, start: int) -> int:
        cap = self.policy.max_tool_result_tokens
        return sum(prompt_size(m, cap) for m in self.messages[start:])

    def smallest(self) -> int:
        """need of the smallest allowed prompt: no summary, the latest valid start."""
        return self.base + self.messages_from(self.starts[-1]) + self.max_tokens

    @property
    def summary(self) -> SummaryState | None:
        """The running summary, placed only if it fits beside the smallest allowed prompt."""
        running = self.running
        fits = running is not None and self.smallest() + running.num_tokens <= self.limit
        return running if fits else None

    @property
    def fixed(self) -> int:  # system + placed summary + generation prompt
        return self.base + (self.summary.num_tokens if self.summary is not None else 0)

    def prompt(self, start: int) -> int:
        return self.fixed + self.messages_from(start)

    def need(self, start: int) -> int:
        return self.prompt(start) + self.max_tokens

    def choice(self) -> int | None:
        """The trim point the rules choose, or None when the turn must be refused."""
        name, limit, need = self.policy.policy, self.limit, self.need
        first_fit = next((s for s in self.starts if need(s) <= limit), None)
        if name == "none":
            return self.previous if need(self.previous) <= limit else None
        if name == "drop_oldest" or first_fit is None:
            return first_fit
        if need(self.previous) <= self.policy.high_watermark * limit + 1e-9:
            return self.previous
        low = self.policy.low_watermark * limit + 1e-9
        return next((s for s in self.starts if need(s) <= low), first_fit)

    def refused_tokens(self) -> int:
        """What a refusal reports: need from the trim point under `none`, else the smallest."""
        return self.need(self.previous if self.policy.policy == "none" else self.starts[-1])


def read_rules(
    messages: Sequence[HistoryMessage],
    policy: HistoryPolicy,
    *,
    limit: int,
    max_tokens: int,
    system: int = 0,
    gen: int = 0,
    summary: SummaryState | None = None,
    start_id: str | None = None,
) -> Reading:
    ids = [m.message_id for m in messages]
    valid = [0] + [i for i, m in enumerate(messages) if i > 0 and m.role == "user"]
    previous = ids.index(start_id) if start_id in ids else 0
    if previous not in valid:
        previous = 0
    k = len(summary.covers) if summary is not None else 0
    honoured = summary is not None and 0 < k <= previous and tuple(ids[:k]) == summary.covers
    running = summary if policy.policy == "summarize" and honoured else None
    starts = [s for s in valid if s >= previous]
    return Reading(messages, policy, limit, max_tokens, starts, previous, running, system + gen)


def check_plan(plan: ContextPlan, r: Reading) -> None:
    """Every rule a plan keeps, against the brute-force reading."""
    messages = r.messages
    ids = tuple(m.message_id for m in messages)
    start = len(ids) - len(plan.kept)
    assert start == r.choice()
    assert plan.num_prompt_tokens + r.max_tokens <= r.limit
    assert plan.num_prompt_tokens == r.prompt(start)
    assert plan.kept == ids[start:], "kept is not a suffix of the branch"
    assert plan.dropped == ids[:start]
    if ids:
        assert plan.kept[-1] == ids[-1], "the newest message was dropped"
        assert plan.start_id == ids[start]
    else:
        assert plan.start_id is None
    if plan.dropped:
        assert messages[start].role == "user", "the prompt starts on a non-user message"
    owner = unit_of(messages)
    assert start == len(ids) or owner[start] == start, "a tool-call unit was split"
    assert plan.trimmed == (start != r.previous)
    assert plan.num_dropped_tokens == r.need(r.previous) - r.need(start)
    cap = r.policy.max_tool_result_tokens
    assert dict(plan.capped) == {
        m.message_id: cap
        for m in messages[start:]
        if cap is not None and m.role == "tool" and m.content_tokens > cap
    }
    assert plan.summary == r.summary
    assert plan.summary_left_out == (r.running if r.summary is None else None)
    assert plan.running_summary == r.running
    if plan.running_summary is not None:
        covers = plan.running_summary.covers
        assert covers and plan.dropped[: len(covers)] == covers
    if r.policy.policy == "summarize":
        covered = plan.running_summary.covers if plan.running_summary is not None else ()
        assert covered + plan.to_summarize == plan.dropped
    else:
        assert plan.running_summary is None and plan.to_summarize == ()


def plan_or_refusal(r: Reading, **kwargs: object) -> ContextPlan | None:
    """Plans with `kwargs`; on a refusal, checks it was due and states the right numbers."""
    try:
        plan = plan_context(**kwargs)  # type: ignore[arg-type]
    except ContextLengthExceeded as e:
        assert r.choice() is None, "refused a turn that fits"
        assert r.refused_tokens() > r.limit, "refused though the smallest allowed prompt fits"
        assert (e.num_tokens, e.limit, e.max_tokens) == (r.refused_tokens(), r.limit, r.max_tokens)
        return None
    check_plan(plan, r)
    return plan


# -- one plan, random everything ---------------------------------------------------------------


@st.composite
def summaries(
    draw: st.DrawFn, ids: list[str], start_id: str | None, max_tokens: int = 150
) -> SummaryState | None:
    """None, a summary of a leading run (often one before the trim point), or one whose
    covers do not match the branch; of 0 to `max_tokens` tokens."""
    kind = draw(st.sampled_from(["none", "leading", "leading", "other"]))
    if kind == "none" or not ids:
        return None
    if kind == "leading":
        before = ids.index(start_id) if start_id in ids else 0
        covers = tuple(ids[: draw(st.integers(1, max(1, before)) | st.integers(1, len(ids)))])
    else:
        covers = tuple(draw(st.lists(st.sampled_from([*ids, "gone"]), min_size=1, unique=True)))
    return SummaryState("earlier: ...", draw(st.integers(0, max_tokens)), covers)


def plan_with_random_budget(
    data: st.DataObject,
    messages: list[HistoryMessage],
    policy: HistoryPolicy,
    summary: SummaryState | None,
    start_id: str | None,
) -> ContextPlan | None:
    """Draws a budget and plans; checks the plan (or the refusal) against the rules."""
    system, gen = data.draw(st.integers(0, 100)), data.draw(st.integers(0, 8))
    max_tokens = data.draw(st.integers(1, 200))
    r = read_rules(messages, policy, limit=0, max_tokens=max_tokens, system=system, gen=gen,
                   summary=summary, start_id=start_id)  # fmt: skip
    # Budgets around the edges that matter: the smallest allowed prompt (under it the turn is
    # refused), the same with the summary (under it the summary is left out) and the prompt
    # from the trim point with the summary (over it nothing needs dropping).
    smallest = r.smallest()
    with_summary = smallest + (r.running.num_tokens if r.running is not None else 0)
    whole = with_summary + r.messages_from(r.previous) - r.messages_from(r.starts[-1])
    r.limit = limit = data.draw(
        st.one_of(
            st.integers(1, smallest + 1),
            st.integers(max(1, with_summary - 1), with_summary + 1),
            st.integers(smallest, whole + 1),
            st.integers(max(1, whole - 1), 2 * whole),
        )
    )
    return plan_or_refusal(
        r,
        messages=messages,
        system_tokens=system,
        max_context_tokens=limit,
        max_tokens=max_tokens,
        policy=policy,
        summary=summary,
        start_id=start_id,
        generation_prompt_tokens=gen,
    )


@FAST
@given(data=st.data())
def test_every_plan_keeps_the_rules(data: st.DataObject) -> None:
    messages = data.draw(conversations())
    ids = [m.message_id for m in messages]
    users = [m.message_id for m in messages[1:] if m.role == "user"]  # valid trim points
    start_id = data.draw(st.sampled_from([None, "gone", *ids, *users, *users, *users]))
    summary = data.draw(summaries(ids, start_id))
    plan_with_random_budget(data, messages, data.draw(policies()), summary, start_id)


@FAST
@given(data=st.data())
def test_summaries_that_apply_keep_the_rules(data: st.DataObject) -> None:
    conv = Conversation()
    conv.messages = data.draw(conversations(max_units=10))
    conv.user(data.draw(sizes))  # so there is a valid trim point past the first message
    ids = [m.message_id for m in conv.messages]
    start = data.draw(st.sampled_from([i for i, m in enumerate(conv.messages[1:], 1)
                                       if m.role == "user"]))  # fmt: skip
    summary = SummaryState("...", data.draw(st.integers(0, 150)),
                           tuple(ids[: data.draw(st.integers(1, start))]))  # fmt: skip
    policy = data.draw(policies(["summarize"]))
    plan = plan_with_random_budget(data, conv.messages, policy, summary, ids[start])
    assert plan is None or plan.running_summary == summary


def smallest_need(
    messages: Sequence[HistoryMessage], policy: HistoryPolicy, base: int, max_tokens: int
) -> int:
    """need of the smallest prompt a dropping policy may plan, read independently of the
    planner: `base` (system + generation prompt), the newest user message on (the whole branch
    when none follows the first message), max_tokens; no summary."""
    last = max([0] + [i for i, m in enumerate(messages) if i > 0 and m.role == "user"])
    cap = policy.max_tool_result_tokens
    return base + sum(prompt_size(m, cap) for m in messages[last:]) + max_tokens


@FAST
@given(data=st.data())
def test_a_turn_whose_smallest_prompt_fits_is_never_refused(data: st.DataObject) -> None:
    # Summaries up to far past the budget, as one made before the budget was lowered (the
    # report: 548 tokens in a budget of 256) or under the old unbounded max_summary_tokens.
    messages = data.draw(conversations())
    ids = [m.message_id for m in messages]
    users = [m.message_id for m in messages[1:] if m.role == "user"]
    start_id = data.draw(st.sampled_from([None, *ids, *users, *users]))
    summary = data.draw(summaries(ids, start_id, max_tokens=1200))
    policy = data.draw(policies(["summarize", "drop", "drop_oldest"]))
    system, gen, max_tokens = data.draw(st.integers(0, 100)), data.draw(st.integers(0, 8)), \
        data.draw(st.integers(1, 200))  # fmt: skip
    smallest = smallest_need(messages, policy, system + gen, max_tokens)
    limit = data.draw(st.integers(max(1, smallest - 3), smallest + 800))
    args = dict(messages=messages, system_tokens=system, max_context_tokens=limit,
                max_tokens=max_tokens, policy=policy, summary=summary, start_id=start_id,
                generation_prompt_tokens=gen)  # fmt: skip
    if smallest > limit:
        with pytest.raises(ContextLengthExceeded) as refused:
            plan_context(**args)  # type: ignore[arg-type]
        assert refused.value.num_tokens == smallest  # a summary is never counted against it
        return
    p = plan_context(**args)  # type: ignore[arg-type]
    assert p.num_prompt_tokens + max_tokens <= limit
    placed = p.summary.num_tokens if p.summary is not None else 0
    kept = [m for m in messages if m.message_id in p.kept]
    cap = policy.max_tool_result_tokens
    assert p.num_prompt_tokens == system + gen + placed + sum(prompt_size(m, cap) for m in kept)
    if p.summary_left_out is not None:  # left out only when it does not fit
        assert smallest + p.summary_left_out.num_tokens > limit


# -- many turns: the prefix holds between trim events ---------------------------------------------


@dataclass
class Session:
    """A simulated session: the caller's side of the contract (store the trim point, start a
    summary when one is due, install it on a later turn)."""

    policy: HistoryPolicy
    limit: int
    system: int
    max_tokens: int
    conv: Conversation
    start_id: str | None = None
    summary: SummaryState | None = None
    pending: SummaryState | None = None
    summary_tokens: int = 40  # each summary made, as placed
    plans: int = 0
    trims: int = 0

    def turn(self) -> tuple[ContextPlan, Reading]:
        if self.pending is not None:  # generated at low priority since the last turn
            self.summary, self.pending = self.pending, None
        messages = list(self.conv.messages)
        r = read_rules(
            messages, self.policy, limit=self.limit, max_tokens=self.max_tokens,
            system=self.system, summary=self.summary, start_id=self.start_id,
        )  # fmt: skip
        plan = plan_context(
            messages=messages, system_tokens=self.system, max_context_tokens=self.limit,
            max_tokens=self.max_tokens, policy=self.policy, summary=self.summary,
            start_id=self.start_id,
        )  # fmt: skip
        check_plan(plan, r)
        if plan.to_summarize:
            self.pending = merge_summary(plan.running_summary, "...", self.summary_tokens,
                                         plan.to_summarize)  # fmt: skip
        self.start_id = plan.start_id
        self.plans += 1
        self.trims += plan.trimmed
        return plan, r


def run_session(session: Session, script: list[tuple[int, int, int]]) -> None:
    """Plays `script` (user tokens, assistant tokens, tool calls) turn by turn, checking
    that between trim events the prompt only grows at its end."""
    before: ContextPlan | None = None
    for user, reply, num_calls in script:
        session.conv.user(user)
        for round_ in range(2):  # a user turn, then (with tool calls) one round of results
            summary_before = session.summary
            plan, r = session.turn()
            if before is not None and not plan.trimmed:
                assert plan.kept[: len(before.kept)] == before.kept, "prefix moved untrimmed"
                if session.summary is summary_before:
                    assert plan.summary == before.summary
            if plan.trimmed and session.policy.policy == "drop_oldest":
                assert r.need(r.previous) > session.limit
            if plan.trimmed and session.policy.policy in ("drop", "summarize"):
                high = session.policy.high_watermark_tokens(session.limit)
                low = session.policy.low_watermark_tokens(session.limit)
                assert r.need(r.previous) > high
                start = len(session.conv.messages) - len(plan.kept)
                reachable = any(r.need(s) <= low for s in r.starts)
                assert r.need(start) <= low if reachable else r.need(start) <= session.limit
            before = plan
            calls = session.conv.assistant(reply, num_calls if round_ == 0 else 0)
            if not calls:
                break
            for call in calls:
                session.conv.tool(call, reply + 4, reply)


turns = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 60), st.sampled_from([0, 0, 0, 1, 2, 3])),
    min_size=10,
    max_size=60,
)


@SIMULATIONS
@given(
    script=turns,
    policy=policies(["drop", "summarize", "drop_oldest"]),
    limit=st.integers(600, 2000),
)
def test_prefix_holds_between_trim_events(
    script: list[tuple[int, int, int]], policy: HistoryPolicy, limit: int
) -> None:
    # The largest smallest prompt: system 60 + summary 40 + user 40 + call 60 + 3 results of
    # 64 + 128 reserved = 520 < 600, so no turn is refused and every turn is checked.
    session = Session(policy, limit, system=60, max_tokens=128, conv=Conversation())
    run_session(session, script)
    assert session.plans >= len(script)


@SIMULATIONS
@given(
    script=turns,
    limit=st.integers(400, 2000),
    lowered=st.integers(320, 2000),
    at=st.integers(0, 40),
    made_to=st.sampled_from(["share", "old default"]),
)
def test_summaries_never_lock_a_session_out(
    script: list[tuple[int, int, int]], limit: int, lowered: int, at: int, made_to: str
) -> None:
    # Summaries made to their share of the budget of the moment (as the service generates
    # them), or to 548 tokens (the old default of 512 generated, with its markup); from turn
    # `at` the operator lowers the budget. The largest smallest prompt: system 20 + user 40 +
    # call 60 + 3 results of 64 + 4 reserved = 316 < 320, so every turn must be planned.
    policy = HistoryPolicy("summarize")
    session = Session(policy, limit, system=20, max_tokens=4, conv=Conversation())
    for turn, (user, reply, num_calls) in enumerate(script):
        if turn == at:
            session.limit = min(limit, lowered)
        share = policy.summary_share_tokens(session.limit)
        session.summary_tokens = share if made_to == "share" else 548
        session.conv.user(user)
        for round_ in range(2):
            plan, r = session.turn()  # checked against the rules; a refusal fails the test
            assert plan.num_prompt_tokens + 4 <= session.limit
            if plan.summary is not None:
                assert r.smallest() + plan.summary.num_tokens <= session.limit
            elif r.running is not None:  # left out only when it does not fit
                assert r.smallest() + r.running.num_tokens > session.limit
            calls = session.conv.assistant(reply, num_calls if round_ == 0 else 0)
            if not calls:
                break
            for call in calls:
                session.conv.tool(call, reply + 4, reply)
    assert session.plans >= len(script)


long_turns = st.lists(
    st.tuples(st.integers(10, 40), st.integers(10, 60), st.sampled_from([0, 0, 1])),
    min_size=40,
    max_size=60,
)


@SIMULATIONS
@given(script=long_turns)
def test_drop_oldest_trims_more_often_than_watermarks(script: list[tuple[int, int, int]]) -> None:
    # A conversation several times the 800-token budget, in units well under the gap between
    # the watermarks: drop trims once per ~0.3 x budget of growth, drop_oldest nearly every
    # turn once the window is full (at least 2.4x as often over 1,500 drawn scripts).
    counts = {}
    for name in ("drop", "drop_oldest"):
        session = Session(HistoryPolicy(name), 800, 60, 128, Conversation())
        run_session(session, script)
        counts[name] = session.trims
    assert counts["drop"] >= 1
    assert counts["drop_oldest"] >= 2 * counts["drop"]


def test_sixty_turns_drop_oldest_changes_the_prefix_far_more_often() -> None:
    # Turn t: user 30 tokens, reply 70; system 50, max_tokens 100, budget 1000. Keeping k full
    # turns before the new user message needs 180 + 100k tokens.
    # drop: over 800 at k = 7, cut to k = 3 (<= 500): trims at turns 8, 12, ..., 60 (14).
    # drop_oldest: over 1000 at k = 9, cut to k = 8: trims at every turn from 10 on (51).
    # A turn's prompt is new from its first changed token: the new user message (30) when the
    # trim point holds, everything after the system prompt (100k + 30) when it moved.
    prefill = {}
    for name, trims, prefill_tokens in (("drop", 14, 6050), ("drop_oldest", 51, 42650)):
        conv, start_id, total, trim_turns = Conversation(), None, 0, []
        for turn in range(1, 61):
            conv.user(30)
            plan = plan_context(
                messages=conv.messages, system_tokens=50, max_context_tokens=1000,
                max_tokens=100, policy=HistoryPolicy(name), start_id=start_id,
            )  # fmt: skip
            new = plan.num_prompt_tokens - 50 if plan.trimmed or turn == 1 else 30
            total += new + (50 if turn == 1 else 0)
            if plan.trimmed:
                trim_turns.append(turn)
                assert plan.num_dropped_tokens == (400 if name == "drop" else 100)
            start_id = plan.start_id
            conv.assistant(70)
        assert len(trim_turns) == trims
        assert trim_turns[:2] == ([8, 12] if name == "drop" else [10, 11])
        assert total == prefill_tokens
        prefill[name] = total
    assert prefill["drop_oldest"] >= 3 * prefill["drop"]


# -- boundaries, one by one ------------------------------------------------------------------------


def three_messages() -> list[HistoryMessage]:
    conv = Conversation()
    conv.user(30)
    conv.assistant(70)
    conv.user(30)
    return conv.messages


def plan(messages: Sequence[HistoryMessage], limit: int, **kwargs: object) -> ContextPlan:
    args: dict[str, object] = dict(system_tokens=50, max_tokens=100, policy=HistoryPolicy())
    args.update(kwargs)
    return plan_context(messages=messages, max_context_tokens=limit, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", POLICIES)
def test_budget_exactly_met_keeps_everything(name: str) -> None:
    # need = 50 system + 130 messages + 100 reserved = 280
    p = plan(three_messages(), 280, policy=HistoryPolicy(name, 1.0, 1.0))
    assert p.kept == ("m0", "m1", "m2") and p.dropped == () and not p.trimmed
    assert p.num_prompt_tokens == 180 and p.start_id == "m0"


def test_one_token_over_drops_the_oldest_unit_or_refuses() -> None:
    p = plan(three_messages(), 279, policy=HistoryPolicy("drop_oldest"))
    assert (p.kept, p.dropped, p.start_id) == (("m2",), ("m0", "m1"), "m2")
    assert (p.num_prompt_tokens, p.trimmed, p.num_dropped_tokens) == (80, True, 100)
    with pytest.raises(ContextLengthExceeded) as refused:
        plan(three_messages(), 279, policy=HistoryPolicy("none"))
    assert (refused.value.num_tokens, refused.value.limit) == (280, 279)


def watermark_case(first: int, middle: int, last: int) -> list[HistoryMessage]:
    conv = Conversation()
    for size in (first, 100, 100, middle, last):  # user, assistant, user, assistant, user
        (conv.user if len(conv.messages) % 2 == 0 else conv.assistant)(size)
    return conv.messages


def test_watermarks_exactly_at_high_hold_one_over_trims_to_low() -> None:
    drop = dict(system_tokens=0, policy=HistoryPolicy("drop", 0.8, 0.5))
    held = plan(watermark_case(300, 100, 100), 1000, **drop)  # need 800 = high
    assert held.kept == ("m0", "m1", "m2", "m3", "m4") and not held.trimmed
    moved = plan(watermark_case(300, 100, 101), 1000, **drop)  # need 801; from m2: 401
    assert moved.kept == ("m2", "m3", "m4") and moved.trimmed
    assert (moved.num_prompt_tokens, moved.num_dropped_tokens) == (301, 400)


def test_trim_stops_at_the_first_start_under_low_exactly_met_or_one_over() -> None:
    drop = dict(system_tokens=0, policy=HistoryPolicy("drop", 0.8, 0.5))
    at_low = plan(watermark_case(300, 200, 100), 1000, **drop)  # from m2: need 500 = low
    assert at_low.start_id == "m2" and at_low.num_prompt_tokens == 400
    over = plan(watermark_case(300, 201, 100), 1000, **drop)  # from m2: 501; from m4: 200
    assert over.start_id == "m4" and over.num_prompt_tokens == 100


def test_no_start_reaches_low_takes_the_first_that_fits() -> None:
    # need 50 + 900 + 100 from m0; from m2 (the only later start): 50 + 600 + 100 = 750
    conv = Conversation()
    conv.user(200)
    conv.assistant(100)
    conv.user(600)
    p = plan(conv.messages, 1000)
    assert p.start_id == "m2" and p.num_prompt_tokens + 100 == 750 > 500


def test_only_the_newest_message_and_an_empty_branch() -> None:
    conv = Conversation()
    conv.user(10)
    p = plan(conv.messages, 160, generation_prompt_tokens=0)
    assert (p.kept, p.start_id, p.dropped, p.num_prompt_tokens) == (("m0",), "m0", (), 60)
    with pytest.raises(ContextLengthExceeded) as refused:
        plan(conv.messages, 159)
    assert (refused.value.num_tokens, refused.value.limit) == (160, 159)
    empty = plan([], 155, generation_prompt_tokens=5)
    assert (empty.kept, empty.start_id, empty.num_prompt_tokens) == ((), None, 55)


def tool_loop(content_tokens: int) -> list[HistoryMessage]:
    conv = Conversation()
    conv.user(20)
    (call,) = conv.assistant(20, 1)
    conv.tool(call, content_tokens + 6, content_tokens)
    return conv.messages


def test_tool_result_cap_exactly_at_the_limit_and_one_over() -> None:
    capped = HistoryPolicy("drop", max_tool_result_tokens=32)
    whole = plan(tool_loop(32), 10_000, policy=capped)
    assert dict(whole.capped) == {} and whole.num_prompt_tokens == 50 + 40 + 38
    cut = plan(tool_loop(33), 10_000, policy=capped)
    assert dict(cut.capped) == {"m2": 32} and cut.num_prompt_tokens == 50 + 40 + 38
    uncapped = plan(tool_loop(5000), 10_000, policy=HistoryPolicy("drop"))
    assert dict(uncapped.capped) == {} and uncapped.num_prompt_tokens == 50 + 40 + 5006


def test_tool_cap_split_fits_head_marker_tail_in_the_cap() -> None:
    assert tool_cap_split(100, 40, 10) == (15, 15)
    assert tool_cap_split(100, 41, 10) == (16, 15)
    assert tool_cap_split(40, 40, 10) == (40, 0)  # within the cap: whole, no marker
    assert tool_cap_split(41, 40, 40) == (0, 0)  # the marker alone
    with pytest.raises(InvalidHistoryError, match="no room"):
        tool_cap_split(41, 40, 41)
    assert TOOL_CUT_MARKER.format(n=1234).strip() == "[... 1234 tokens cut ...]"


@given(content=st.integers(0, 5000), cap=st.integers(32, 2000), marker=st.integers(0, 32))
def test_tool_cap_split_property(content: int, cap: int, marker: int) -> None:
    head, tail = tool_cap_split(content, cap, marker)
    if content <= cap:
        assert (head, tail) == (content, 0)
    else:
        assert head + marker + tail == cap and head - tail in (0, 1)


def test_agent_loop_keeps_the_user_message_that_started_it() -> None:
    conv = Conversation()
    conv.user(400)
    conv.assistant(400)
    conv.user(20)  # m2 starts the loop
    for _ in range(2):
        (call,) = conv.assistant(20, 1)
        conv.tool(call, 20, 14)
    loop = ("m2", "m3", "m4", "m5", "m6")
    p = plan(conv.messages, 500, policy=HistoryPolicy("drop_oldest"))
    assert p.kept == loop and p.num_prompt_tokens == 50 + 100
    with pytest.raises(ContextLengthExceeded) as refused:
        plan(conv.messages, 249, policy=HistoryPolicy("drop_oldest"))
    assert (refused.value.num_tokens, refused.value.limit) == (250, 249)


def test_a_greeting_before_the_first_user_message_stays_until_trimmed() -> None:
    conv = Conversation()
    for size in (50, 50, 50, 50):  # assistant greeting, user, assistant, user
        (conv.assistant if len(conv.messages) % 2 == 0 else conv.user)(size)
    whole = plan(conv.messages, 10_000)
    assert whole.kept[0] == "m0" and whole.start_id == "m0"
    trimmed = plan(conv.messages, 300, policy=HistoryPolicy("drop_oldest"))
    assert trimmed.kept == ("m1", "m2", "m3")


def test_branch_switch_with_unknown_trim_point_plans_from_the_beginning() -> None:
    messages = three_messages()
    summary = SummaryState("old branch", 20, ("m0",))
    for start_id in ("gone", "m1"):  # unknown, and an assistant message (not a valid start)
        p = plan(messages, 10_000, start_id=start_id, summary=summary,
                 policy=HistoryPolicy("summarize"))  # fmt: skip
        assert p.kept == ("m0", "m1", "m2") and not p.trimmed
        assert p.summary is None and p.num_prompt_tokens == 180
    p = plan(messages, 200, start_id="gone", summary=summary, policy=HistoryPolicy("summarize"))
    assert p.kept == ("m2",) and p.trimmed and p.num_dropped_tokens == 100
    assert p.summary is None and p.to_summarize == ("m0", "m1")


def test_summary_applies_only_to_a_leading_run_before_the_trim_point() -> None:
    conv = Conversation()
    for size in (10, 10, 10, 10, 10):
        (conv.user if len(conv.messages) % 2 == 0 else conv.assistant)(size)
    summarize = HistoryPolicy("summarize")
    good = SummaryState("s", 15, ("m0",))
    p = plan(conv.messages, 10_000, start_id="m2", summary=good, policy=summarize)
    assert p.summary == good and p.to_summarize == ("m1",) and p.num_prompt_tokens == 50 + 15 + 30
    for bad in (("m0", "m1", "m2"), ("m1",), ("m0", "m2")):  # past the trim point, not leading
        p = plan(conv.messages, 10_000, start_id="m2", summary=SummaryState("s", 15, bad),
                 policy=summarize)  # fmt: skip
        assert p.summary is None and p.to_summarize == ("m0", "m1")
    dropping = plan(conv.messages, 10_000, start_id="m2", summary=good)  # policy drop
    assert dropping.summary is None and dropping.to_summarize == ()
    assert dropping.num_prompt_tokens == 50 + 30


def test_summarize_trim_keeps_the_previous_summary_and_lists_the_rest() -> None:
    conv = Conversation()
    for size in (100, 100, 100, 100, 100):
        (conv.user if len(conv.messages) % 2 == 0 else conv.assistant)(size)
    summary = SummaryState("s", 50, ("m0", "m1"))
    # from m2: 50 + 50 + 300 + 100 = 500 > 0.8 x 600; from m4: 300 <= 0.5 x 600
    p = plan(conv.messages, 600, start_id="m2", summary=summary, policy=HistoryPolicy("summarize"))
    assert p.kept == ("m4",) and p.summary == summary and p.to_summarize == ("m2", "m3")
    assert p.num_dropped_tokens == 200 and p.num_prompt_tokens == 50 + 50 + 100


def five_messages(size: int) -> list[HistoryMessage]:
    conv = Conversation()
    for _ in range(5):
        (conv.user if len(conv.messages) % 2 == 0 else conv.assistant)(size)
    return conv.messages


def test_a_summary_the_budget_no_longer_holds_is_left_out() -> None:
    # The report: budget 256, max_tokens 4, a 548-token summary of m0, m1, trim point m2.
    # Without it, need from m2 is 20 + 90 + 4 = 114 <= 0.8 x 256: nothing more is dropped.
    summary = SummaryState("s", 548, ("m0", "m1"))
    p = plan(five_messages(30), 256, system_tokens=20, max_tokens=4, start_id="m2",
             summary=summary, policy=HistoryPolicy("summarize"))  # fmt: skip
    assert p.summary is None and p.summary_left_out == summary and p.running_summary == summary
    assert p.kept == ("m2", "m3", "m4") and not p.trimmed and p.to_summarize == ()
    assert p.num_prompt_tokens == 20 + 90


def test_a_summary_exactly_fitting_beside_the_newest_message_is_placed_one_over_is_not() -> None:
    # smallest: 20 system + 30 (m4) + 4 = 54, so a summary of 202 just fits in 256.
    args: dict[str, object] = dict(system_tokens=20, max_tokens=4, start_id="m2",
                                   policy=HistoryPolicy("summarize"))  # fmt: skip
    fits = SummaryState("s", 202, ("m0", "m1"))
    p = plan(five_messages(30), 256, summary=fits, **args)
    # with it, from m2: 316 > 204 (high); no start reaches 128 (low); m4 fits exactly.
    assert p.summary == fits and p.summary_left_out is None and p.kept == ("m4",)
    assert p.trimmed and p.to_summarize == ("m2", "m3") and p.num_prompt_tokens + 4 == 256
    over = SummaryState("s", 203, ("m0", "m1"))
    p = plan(five_messages(30), 256, summary=over, **args)
    assert p.summary is None and p.summary_left_out == over and p.kept == ("m2", "m3", "m4")
    # Refused only when the smallest prompt alone does not fit; its need counts no summary.
    with pytest.raises(ContextLengthExceeded) as refused:
        plan(five_messages(30), 53, summary=over, **args)
    assert (refused.value.num_tokens, refused.value.limit) == (54, 53)
    # A stale summary (not a leading run) is neither placed nor left out: it does not apply.
    stale = plan(five_messages(30), 256, summary=SummaryState("s", 999, ("m1",)), **args)
    assert stale.summary is None and stale.summary_left_out is None
    assert stale.to_summarize == ("m0", "m1")


def test_the_summary_share_bounds_what_is_generated() -> None:
    policy = HistoryPolicy("summarize")  # max_summary_tokens 512
    assert policy.summary_share_tokens(256) == 64 and policy.summary_share_tokens(4099) == 1024
    assert summary_max_new_tokens(policy, 256, 12) == 52  # the share less the markup
    assert summary_max_new_tokens(policy, 100_000, 12) == 512  # max_summary_tokens bounds it
    assert summary_max_new_tokens(HistoryPolicy(max_summary_tokens=51), 256, 12) == 51
    assert summary_max_new_tokens(policy, 56, 13) == 1  # share 14: one token of text
    assert summary_max_new_tokens(policy, 55, 13) == 0  # share 13: no room for any text
    assert summary_max_new_tokens(policy, 8, 13) == 0
    with pytest.raises(InvalidHistoryError):
        summary_max_new_tokens(policy, 256, -1)


def test_none_keeps_the_trim_point_it_is_given() -> None:
    p = plan(three_messages(), 10_000, start_id="m2", policy=HistoryPolicy("none"))
    assert p.kept == ("m2",) and not p.trimmed


def test_context_length_error_states_both_numbers() -> None:
    e = ContextLengthExceeded(1234, 1000, max_tokens=200)
    assert str(e) == (
        "This model's maximum context length is 1000 tokens. However, you requested 1234 "
        "tokens (1034 in the messages, 200 in the completion). Please reduce the length of the "
        "messages or completion."
    )
    assert e.code == "context_length_exceeded" and e.param == "messages"
    assert isinstance(e, ValueError)
    again = pickle.loads(pickle.dumps(e))
    assert (again.num_tokens, again.limit, str(again)) == (1234, 1000, str(e))
    assert "your messages resulted in 1234 tokens" in str(ContextLengthExceeded(1234, 1000))


def test_units_group_calls_with_their_results() -> None:
    conv = Conversation()
    conv.user(1)
    a, b = conv.assistant(1, 2)
    conv.tool(b, 1, 1)
    conv.tool(a, 1, 1)
    conv.assistant(1)
    conv.user(1)
    conv.assistant(1, 1)  # a call not answered yet
    conv.user(1)
    assert units(conv.messages) == [(0, 1), (1, 4), (4, 5), (5, 6), (6, 7), (7, 8)]
    assert units([]) == []


def bad_branches() -> list[tuple[str, list[HistoryMessage]]]:
    u, t = HistoryMessage("u", "user", 1), HistoryMessage("t", "tool", 1, tool_call_id="c")
    call = HistoryMessage("a", "assistant", 1, tool_call_ids=("c",))
    return [
        ("not make", [t]),
        ("not make", [u, t]),
        ("not make", [HistoryMessage("a", "assistant", 1, tool_call_ids=("x",)), t]),
        ("not make", [call, u, t]),
        ("second time", [call, t, HistoryMessage("t2", "tool", 1, tool_call_id="c")]),
        ("unique", [u, u]),
    ]


@pytest.mark.parametrize(("match", "messages"), bad_branches())
def test_broken_tool_sequences_are_refused(match: str, messages: list[HistoryMessage]) -> None:
    with pytest.raises(InvalidHistoryError, match=match):
        plan(messages, 10_000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(role="system"), "system prompt is passed"),
        (dict(role="bot"), "role 'bot'"),
        (dict(num_tokens=-1), "content_tokens <= num_tokens"),
        (dict(content_tokens=-1), "content_tokens <= num_tokens"),
        (dict(content_tokens=11), "content_tokens <= num_tokens"),
        (dict(role="tool"), "need tool_call_id"),
        (dict(tool_call_id="c"), "need tool_call_id"),
        (dict(tool_call_ids=("c",)), "only assistant"),
        (dict(role="assistant", tool_call_ids=("c", "c")), "repeats"),
    ],
)
def test_bad_messages_are_refused(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = dict(message_id="m", role="user", num_tokens=10)
    fields.update(kwargs)
    with pytest.raises(InvalidHistoryError, match=match):
        HistoryMessage(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_context_tokens=0), "max_context_tokens"),
        (dict(system_tokens=-1), "system_tokens"),
        (dict(generation_prompt_tokens=-1), "generation_prompt_tokens"),
    ],
)
def test_bad_budgets_are_refused(kwargs: dict[str, int], field: str) -> None:
    args: dict[str, object] = dict(messages=three_messages(), system_tokens=0, max_tokens=1,
                                   max_context_tokens=1000, policy=HistoryPolicy())  # fmt: skip
    args.update(kwargs)
    with pytest.raises(InvalidHistoryError, match=field) as refused:
        plan_context(**args)  # type: ignore[arg-type]
    assert refused.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(policy="keep"), "policy"),
        (dict(low_watermark=0.9, high_watermark=0.8), "high_watermark"),
        (dict(low_watermark=-0.1), "low_watermark"),
        (dict(high_watermark=1.01), "high_watermark"),
        (dict(max_tool_result_tokens=31), "max_tool_result_tokens"),
        (dict(max_summary_tokens=0), "max_summary_tokens"),
    ],
)
def test_bad_policies_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(HistoryPolicyError) as refused:
        HistoryPolicy(**kwargs)  # type: ignore[arg-type]
    assert refused.value.field == field


def test_watermark_tokens_round_before_flooring() -> None:
    policy = HistoryPolicy(high_watermark=0.29, low_watermark=0.29)
    assert policy.high_watermark_tokens(100) == 29 and policy.low_watermark_tokens(100) == 29
    assert HistoryPolicy().high_watermark_tokens(1001) == 800


def test_summarization_prompt_holds_previous_summary_and_transcript() -> None:
    (system, instruction), (user, body) = summarization_messages(
        "Ada is planning a trip.", [("user", "Book Lisbon."), ("assistant", "Booked.")]
    )
    assert (system, user) == ("system", "user")
    for words in ("replaces", "facts", "names", "decisions", "open tasks", "concise"):
        assert words in instruction
    assert body == (
        "Previous summary:\nAda is planning a trip.\n\n"
        "Messages to fold into the summary:\nuser: Book Lisbon.\n\nassistant: Booked."
    )
    (_, (_, first)) = summarization_messages(None, [("tool", "42")])
    assert first == "Messages to fold into the summary:\ntool: 42"
    with pytest.raises(InvalidHistoryError):
        summarization_messages(None, [])


def test_merge_summary_extends_what_it_covers() -> None:
    first = merge_summary(None, "a", 12, ["m0", "m1"])
    assert first == SummaryState("a", 12, ("m0", "m1"))
    second = merge_summary(first, "ab", 20, ("m2",))
    assert second.covers == ("m0", "m1", "m2") and second.num_tokens == 20
    for newly in ((), ("m1",)):
        with pytest.raises(InvalidHistoryError):
            merge_summary(first, "x", 1, newly)


def test_imports_without_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    code = "import sys, kvchat.history; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-P", "-c", code], cwd=root, check=True)
