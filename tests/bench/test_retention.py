"""bench/retention.py's pure parts, without a server: the workload a seed makes (the same for
every policy, each person's timeline its own), the think times' distribution, typing frames'
timing, the live sessions' KV and the pools sized from it, the ideal prompt-token arithmetic,
per-class summaries, the goals at their boundaries, and reading /metrics deltas."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from kvchat.bench.retention_plan import (
    AGENT,
    PERSON,
    RETURN_WINDOW_S,
    THINK_MEDIAN_S,
    THINK_SIGMA,
    ClassSummary,
    Goal,
    PersonTurn,
    PolicyRun,
    Span,
    TurnRecord,
    WorkloadConfig,
    ideal_tokens,
    kv_bytes_per_token,
    live_tokens,
    make_plan,
    mixed_goals,
    nominal_spans,
    quantile,
    running_tokens,
    size_pools,
    summarize,
    think_time_s,
)
from kvchat.bench.retention_replay import deltas, scrape

SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
}


def words(text: str) -> int:
    return len(text.split())


# -- the workload --------------------------------------------------------------------------------


def test_a_seed_makes_the_same_plan_and_another_seed_another() -> None:
    seed = random.randrange(10**6)
    config = WorkloadConfig(seed=seed, num_agents=4, num_people=5)
    assert make_plan(config) == make_plan(config)
    other = make_plan(replace(config, seed=seed + 1))
    assert other.agents != make_plan(config).agents
    assert other.people != make_plan(config).people


def test_a_plan_keeps_to_its_ranges() -> None:
    config = WorkloadConfig(seed=random.randrange(10**6), num_agents=12, num_people=9)
    plan = make_plan(config)
    assert len(plan.agents) == 12 and len(plan.people) == 9
    for agent in plan.agents:
        assert 0 <= agent.arrival_s <= config.agents_arrival_s
        assert config.calls[0] <= len(agent.steps) <= config.calls[1]
        assert agent.num_requests == len(agent.steps) + 1  # the calls, then the answer
        for step in agent.steps:
            assert config.tool_latency_s[0] <= step.latency_s <= config.tool_latency_s[1]
            # "result N: " and its words
            assert config.result_words[0] + 2 <= words(step.result) <= config.result_words[1] + 2
    assert [a.arrival_s for a in plan.agents] == sorted(a.arrival_s for a in plan.agents)
    for person in plan.people:
        assert 0 <= person.arrival_s <= config.people_arrival_s
        assert 1 <= len(person.turns) <= config.max_person_turns
        assert person.turns[0].think_s == 0.0
        assert all(t.think_s > 0 for t in person.turns[1:])
        assert "Here is my text" in person.turns[0].text
        assert all("Here is my text" not in t.text for t in person.turns[1:])
        # Its nominal timeline ends inside the duration
        end = person.arrival_s + config.nominal_turn_s
        end += sum(t.think_s + config.nominal_turn_s for t in person.turns[1:])
        assert end <= config.duration_s


def test_each_persons_timeline_is_its_own() -> None:
    config = WorkloadConfig(seed=random.randrange(10**6), num_agents=0, num_people=6)
    plan = make_plan(config)
    longer = make_plan(replace(config, document_words=config.document_words + 50))
    fewer_agents = make_plan(replace(config, num_agents=3))
    for a, b, c in zip(plan.people, longer.people, fewer_agents.people, strict=True):
        assert [t.think_s for t in a.turns] == [t.think_s for t in b.turns]
        assert a == c
    assert plan.people[0].turns[0].text != longer.people[0].turns[0].text


def test_think_times_follow_the_trace_compressed() -> None:
    rng = random.Random(random.randrange(10**6))
    compression = 20.0
    draws = [think_time_s(rng, compression) for _ in range(20_000)]
    logs = [math.log(d * compression) for d in draws]
    assert statistics.median(draws) == pytest.approx(THINK_MEDIAN_S / compression, rel=0.05)
    assert statistics.pstdev(logs) == pytest.approx(THINK_SIGMA, rel=0.05)
    # the trace's quartile and tail: p25 69 s, p95 621 s
    assert quantile(draws, 0.25) * compression == pytest.approx(69, rel=0.08)
    assert quantile(draws, 0.95) * compression == pytest.approx(621, rel=0.1)


@pytest.mark.parametrize(
    ("think", "lead", "at"),
    [(10.0, 2.0, 8.0), (2.0, 2.0, 0.0), (1.5, 2.0, 0.0), (0.0, 2.0, 0.0), (3.0, 0.0, 3.0)],
)
def test_a_typing_frame_goes_its_lead_before_the_message_or_at_once(
    think: float, lead: float, at: float
) -> None:
    assert PersonTurn(think, "hi").typing_at_s(lead) == at


def test_a_config_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="calls"):
        WorkloadConfig(calls=(5, 3))
    with pytest.raises(ValueError, match="call"):
        WorkloadConfig(calls=(0, 3))
    with pytest.raises(ValueError, match="compression"):
        WorkloadConfig(compression=0)
    with pytest.raises(ValueError, match="typing lead"):
        WorkloadConfig(typing_lead_s=-1)


# -- the live sessions' KV and the pools --------------------------------------------------------


def test_a_span_holds_its_latest_requests_tokens_while_live() -> None:
    span = Span(PERSON, (10.0, 20.0), (100, 250), end=30.0)
    assert span.held_at(9.99) == 0
    assert span.held_at(10.0) == 100
    assert span.held_at(19.99) == 100
    assert span.held_at(20.0) == 250
    assert span.held_at(29.99) == 250
    assert span.held_at(30.0) == 0  # its last turn is over: not live


def test_live_tokens_sum_the_sessions_live_at_each_second() -> None:
    spans = [Span(AGENT, (0.0,), (100,), end=3.0), Span(PERSON, (1.0, 2.0), (10, 20), end=5.0)]
    assert live_tokens(spans) == [100, 110, 120, 20, 20]
    assert live_tokens([]) == []


def test_nominal_spans_grow_each_session_by_what_its_turns_add() -> None:
    config = WorkloadConfig(seed=random.randrange(10**6), num_agents=2, num_people=3)
    plan = make_plan(config)
    spans = nominal_spans(plan, words, service_s=2.0)
    assert [s.klass for s in spans] == [AGENT] * 2 + [PERSON] * 3
    for span, agent in zip(spans, plan.agents, strict=False):
        assert len(span.starts) == agent.num_requests
        assert span.starts[0] == agent.arrival_s
        gaps = [b - a for a, b in zip(span.starts, span.starts[1:], strict=False)]
        assert gaps == pytest.approx([2.0 + s.latency_s for s in agent.steps])
        assert list(span.tokens) == sorted(span.tokens) and span.tokens[0] > words(agent.task)
    for span, person in zip(spans[2:], plan.people, strict=True):
        assert len(span.tokens) == len(person.turns)
        assert span.end == pytest.approx(span.starts[-1] + 2.0)


def test_pools_hold_the_live_kv_over_the_pressure_in_whole_blocks() -> None:
    bpt, block = 46_080, 16
    live = [random.randrange(20_000, 40_000) for _ in range(50)]
    pools = size_pools(
        live, 1_000, bytes_per_token=bpt, block_size=block, pressure=3.5, host_share=1 / 3
    )
    mean = sum(live) / len(live)
    assert pools.device_bytes % (block * bpt) == 0 and pools.host_bytes % (block * bpt) == 0
    assert pools.device_bytes / bpt == pytest.approx(mean / 3.5 * 2 / 3, abs=block)
    assert pools.host_bytes / bpt == pytest.approx(mean / 3.5 / 3, abs=block)
    assert pools.pressure == pytest.approx(3.5, rel=0.01)
    assert pools.live_peak_tokens == max(live)


def test_the_running_requests_floor_the_device_pool_and_lower_the_pressure() -> None:
    bpt, block = 46_080, 16
    pools = size_pools(
        [7_000], 4_000, bytes_per_token=bpt, block_size=block, pressure=3.5, host_share=1 / 3
    )
    assert pools.device_bytes == 4_000 * bpt  # 250 blocks: the floor, exactly met
    assert pools.host_bytes == 2_000 * bpt  # at least half the floor
    assert pools.pressure == pytest.approx(7_000 / 6_000)
    one_more = size_pools(
        [7_000], 4_001, bytes_per_token=bpt, block_size=block, pressure=3.5, host_share=1 / 3
    )
    assert one_more.device_bytes == 251 * block * bpt  # a block more for one token more


def test_running_tokens_are_twice_the_long_sessions_last_request() -> None:
    spans = [Span(PERSON, (0.0,), (n,), 1.0) for n in range(100, 1100, 100)]
    assert running_tokens(spans) == 2 * 900
    assert running_tokens(spans, concurrent=3, q=1.0) == 3 * 1000


def test_kv_bytes_per_token_of_smollm2_135m_in_float32() -> None:
    assert kv_bytes_per_token(SMOLLM2_135M, 4) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(SMOLLM2_135M, 2) == 23_040
    without_head_dim = {k: v for k, v in SMOLLM2_135M.items() if k != "head_dim"}
    assert kv_bytes_per_token(without_head_dim, 4) == 46_080  # 576 / 9 = 64


# -- the ideal -----------------------------------------------------------------------------------


def test_a_first_turns_ideal_is_its_prompt_less_the_shared_prefix() -> None:
    assert ideal_tokens(700, None, 269) == 431
    assert ideal_tokens(269, None, 269) == 0
    assert ideal_tokens(200, None, 269) == 0  # never negative


def test_a_later_turns_ideal_is_what_follows_the_previous_prompt_and_reply() -> None:
    prompt, reply = random.randrange(300, 2_000), random.randrange(1, 64)
    new = random.randrange(1, 200)
    assert ideal_tokens(prompt + reply + new, (prompt, reply), 269) == new
    assert ideal_tokens(prompt + reply, (prompt, reply), 269) == 0
    assert ideal_tokens(prompt, (prompt, reply), 269) == 0  # a shorter history: nothing new


# -- summaries and goals -------------------------------------------------------------------------


def record(klass: str, turn: int, **fields: object) -> TurnRecord:
    r = TurnRecord(klass, 0, turn)
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def test_a_summary_counts_computed_against_ideal_and_quick_returns_on_the_device() -> None:
    records = [
        record(AGENT, 1, prompt_tokens=400, cached_tokens=300, ideal=100, ttft_s=0.5),
        record(
            AGENT,
            2,
            prompt_tokens=500,
            cached_tokens=480,
            ideal=20,
            ttft_s=0.1,
            gap_s=RETURN_WINDOW_S,
            tier_before="device",
        ),
        record(
            AGENT,
            3,
            prompt_tokens=600,
            cached_tokens=400,
            ideal=25,
            ttft_s=1.0,
            gap_s=0.2,
            tier_before="host",
        ),
        record(
            AGENT,
            4,
            prompt_tokens=700,
            cached_tokens=0,
            ideal=30,
            ttft_s=2.0,
            gap_s=RETURN_WINDOW_S + 0.01,
            tier_before="none",
        ),  # gap over the window: not a quick return
        record(AGENT, 5, prompt_tokens=900, error="cut off at the time limit"),
        record(
            PERSON,
            2,
            prompt_tokens=800,
            cached_tokens=700,
            ideal=90,
            ttft_s=0.3,
            gap_s=1.0,
            tier_before="device",
        ),  # a person: never counted as a return of an agent
    ]
    agents = summarize(records, AGENT)
    assert (agents.turns, agents.failed) == (5, 1)
    assert agents.computed == 100 + 20 + 200 + 700
    assert agents.ideal == 175
    assert agents.computed_over_ideal == pytest.approx(1020 / 175)
    assert (agents.quick_returns, agents.quick_on_device) == (2, 1)
    assert agents.device_share == 0.5
    assert agents.ttft_p50_s == 1.0 and agents.ttft_p90_s == 2.0  # nearest rank of 4
    everyone = summarize(records, None)
    assert everyone.turns == 6 and everyone.quick_returns == 2


def test_decode_speed_needs_two_tokens_and_time_after_the_first() -> None:
    assert record(AGENT, 1, completion_tokens=25, ttft_s=0.5, total_s=2.9).decode_tok_s == 10.0
    assert record(AGENT, 1, completion_tokens=1, ttft_s=0.5, total_s=2.9).decode_tok_s is None
    assert record(AGENT, 1, completion_tokens=9, ttft_s=0.5, total_s=0.5).decode_tok_s is None
    assert record(AGENT, 1, completion_tokens=9, total_s=0.5).decode_tok_s is None


def test_a_goal_is_met_at_its_target_and_not_measured_without_a_figure() -> None:
    assert Goal("x", 0.5, 0.5).met is True
    assert Goal("x", 0.5001, 0.5).met is False
    assert Goal("x", 0.95, 0.95, at_most=False).met is True
    assert Goal("x", 0.9499, 0.95, at_most=False).met is False
    assert Goal("x", float("nan"), 0.5).met is None
    assert Goal("x", float("nan"), 0.5).verdict == "not measured"
    assert Goal("x", 0.2, 0.5).target_text == "<= 0.5"


def summary(
    klass: str, *, p50: float, p90: float, computed: int, quick: tuple[int, int] = (0, 0)
) -> ClassSummary:
    return ClassSummary(
        klass, 10, 0, 1_000, computed, 100, p50, p90, 20.0,
        quick_returns=quick[0], quick_on_device=quick[1],
    )  # fmt: skip


def run(p50: float, p90: float, computed: int, quick: tuple[int, int] = (20, 19)) -> PolicyRun:
    return PolicyRun(
        summary("all", p50=p50, p90=p90, computed=computed),
        {
            AGENT: summary(AGENT, p50=p50, p90=p90, computed=computed, quick=quick),
            PERSON: summary(PERSON, p50=p50, p90=p90, computed=computed),
        },
    )


def test_the_mixed_goals_compare_predictive_with_lru_and_pinned() -> None:
    goals = mixed_goals(
        {
            "lru": run(1.0, 4.0, 1_000),
            "pinned": run(1.0, 2.0, 800),
            "predictive": run(1.05, 1.4, 500),
        }
    )
    by_name = {g.name: g for g in goals}
    assert by_name["TTFT p90, predictive / lru"].measured == pytest.approx(0.35)
    assert by_name["TTFT p90, predictive / pinned"].measured == pytest.approx(0.7)
    assert by_name["TTFT p90, predictive / pinned"].met  # exactly at 0.7
    assert by_name["prompt tokens computed, predictive / lru"].met  # exactly at 0.5
    assert by_name["agents' TTFT p50, predictive / lru"].met  # 1.05x: at the 5% allowed
    assert by_name["people's TTFT p50, predictive / lru"].met
    share = by_name[
        f"agents returning within {RETURN_WINDOW_S:g} s served from the device (predictive)"
    ]
    assert share.measured == pytest.approx(0.95) and share.met
    worse = mixed_goals({"lru": run(1.0, 4.0, 1_000), "predictive": run(1.06, 2.1, 501, (20, 18))})
    assert [g.met for g in worse] == [False, None, False, False, False, False]


# -- /metrics ------------------------------------------------------------------------------------

EXPOSITION = """# HELP kvchat:session_hits_total Turns whose session's KV was waiting in a tier.
# TYPE kvchat:session_hits_total counter
kvchat:session_hits_total{tier="device"} %d
kvchat:session_hits_total{tier="disk"} 2.0
# HELP kvchat:kv_bytes_moved_total KV bytes copied between tiers.
# TYPE kvchat:kv_bytes_moved_total counter
kvchat:kv_bytes_moved_total{from="device",to="host"} %d
# HELP kvchat:session_holds_broken_total Held sessions moved down.
# TYPE kvchat:session_holds_broken_total counter
kvchat:session_holds_broken_total 0.0
"""


def test_metrics_deltas_by_name_and_labels() -> None:
    before = scrape(EXPOSITION % (3, 737_280))
    after = scrape(EXPOSITION % (10, 3 * 737_280))
    moved = deltas(before, after)
    assert moved["kvchat:session_hits_total{tier=device}"] == 7
    assert moved["kvchat:session_hits_total{tier=disk}"] == 0
    assert moved["kvchat:kv_bytes_moved_total{from=device,to=host}"] == 2 * 737_280
    assert moved["kvchat:session_holds_broken_total{}"] == 0
