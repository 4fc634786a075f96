"""bench/peers_serving.py's bookkeeping: what counts as sustained, where the knee is, and the
workload every server is sent (the same text for the same user and round)."""

from __future__ import annotations

from bench.peers_serving import RateRun, Turn, Workload, knee


def run_at(rate: float, ttfts: list[float], span: float, failed: int = 0) -> RateRun:
    run = RateRun("s", rate)
    n = len(ttfts)
    for i, ttft in enumerate(ttfts):
        t = Turn(user=i % 3, round=1 + i // 3, scheduled=i / rate)
        t.sent, t.ttft, t.done = i * span / n, ttft, i * span / n + ttft
        run.turns.append(t)
    for _ in range(failed):
        bad = Turn(user=0, round=9, scheduled=0.0)
        bad.error = "HTTP 500"
        run.turns.append(bad)
    return run


def test_sustained_needs_the_rate_a_flat_queue_and_every_answer() -> None:
    steady = run_at(1.0, [0.2] * 10, span=9.0)
    assert steady.served_rate > 0.9 and steady.growth == 1.0 and steady.sustained
    growing = run_at(1.0, [0.2] * 5 + [0.5] * 5, span=9.0)  # second half 2.5x the first
    assert growing.growth == 2.5 and not growing.sustained
    slow = run_at(1.0, [0.2] * 10, span=20.0)  # served half the offered rate
    assert slow.served_rate < 0.9 and not slow.sustained
    assert not run_at(1.0, [0.2] * 10, span=9.0, failed=1).sustained


def test_knee_is_the_last_rate_sustained_before_the_first_that_was_not() -> None:
    runs = [run_at(0.5, [0.2] * 10, 18.0), run_at(1.0, [0.2] * 10, 9.0),
            run_at(2.0, [0.2] * 5 + [1.0] * 5, 4.5), run_at(4.0, [0.2] * 10, 2.2)]
    assert knee(runs) == 1.0
    assert knee(runs[2:]) == 0.0


def test_every_server_gets_the_same_conversation() -> None:
    w = Workload(users=2, rounds=3, system_words=20, question_words=5, answer_tokens=4)
    again = Workload(users=2, rounds=3, system_words=20, question_words=5, answer_tokens=4)
    assert w.system_prompt() == again.system_prompt()
    assert w.question(1, 2) == again.question(1, 2) != w.question(0, 2)
    assert len(w.system_prompt().split()) == 20 + 5
