"""bench/peers_serving.py's bookkeeping: what counts as sustained, where the knee is, and the
workload every server is sent (the same text for the same user and round)."""

from __future__ import annotations

from kvchat.bench.peers_serving import RateRun, Turn, Workload, knee


def run_at(
    rate: float, ttfts: list[float], span: float, late: list[float] | None = None, failed: int = 0
) -> RateRun:
    """3 users' requests on the schedule of `rate`, answered over `span` seconds; request i
    starts `late[i]` seconds after its slot."""
    run = RateRun("s", rate)
    n = len(ttfts)
    late = late or [0.0] * n
    for i, ttft in enumerate(ttfts):
        t = Turn(user=i % 3, round=1 + i // 3, scheduled=i / rate)
        t.sent = t.scheduled + late[i]
        t.ttft, t.done = ttft, i * span / n + ttft
        run.turns.append(t)
    for _ in range(failed):
        bad = Turn(user=0, round=9, scheduled=0.0)
        bad.error = "HTTP 500"
        run.turns.append(bad)
    return run


def test_sustained_needs_the_rate_an_on_time_schedule_and_every_answer() -> None:
    steady = run_at(1.0, [0.2] * 9, span=8.0)
    assert steady.served_rate > 0.9 and steady.behind == 0.0 and steady.sustained
    # TTFT growing with the rounds (a longer history each round) is no queue: still on time.
    longer = run_at(1.0, [0.2, 0.2, 0.2, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9], span=8.0)
    assert longer.behind == 0.0 and longer.sustained
    # Each round starts later than the one before: the queue grows. The users' interval is
    # 3 s; the last round (requests 6-8) starts 2 s late, over half of it.
    falling = run_at(1.0, [0.2] * 9, span=8.0, late=[0, 0, 0, 1, 1, 1, 2, 2, 2.5])
    assert falling.user_interval == 3.0 and falling.behind == 2.0 and not falling.sustained
    slightly = run_at(1.0, [0.2] * 9, span=8.0, late=[0, 0, 0, 0.5, 0.5, 0.5, 1, 1, 1])
    assert slightly.behind == 1.0 and slightly.sustained
    slow = run_at(1.0, [0.2] * 9, span=20.0)  # served under half the offered rate
    assert slow.served_rate < 0.9 and not slow.sustained
    assert not run_at(1.0, [0.2] * 9, span=8.0, failed=1).sustained


def test_knee_is_the_last_rate_sustained_before_the_first_that_was_not() -> None:
    behind = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    runs = [
        run_at(0.5, [0.2] * 9, 16.0),
        run_at(1.0, [0.2] * 9, 8.0),
        run_at(2.0, [0.2] * 9, 4.0, late=[x / 2 for x in behind]),
        run_at(4.0, [0.2] * 9, 2.0),
    ]
    assert [r.sustained for r in runs] == [True, True, False, True]
    assert knee(runs) == 1.0
    assert knee(runs[2:]) == 0.0


def test_every_server_gets_the_same_conversation() -> None:
    w = Workload(users=2, rounds=3, system_words=20, question_words=5, answer_tokens=4)
    again = Workload(users=2, rounds=3, system_words=20, question_words=5, answer_tokens=4)
    assert w.system_prompt() == again.system_prompt()
    assert w.question(1, 2) == again.question(1, 2) != w.question(0, 2)
    assert len(w.system_prompt().split()) == 20 + 5
