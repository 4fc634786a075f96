"""Sessions on the real engine: a conversation's next turn costs only its new tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.config import SessionBudget
from kvchat.memory.sessions import SessionState
from kvchat_testing.engines import random_prompt
from kvchat_testing.session_engines import (
    BLOCK,
    GREEDY,
    NEW,
    ForwardCounter,
    cold,
    make_engine,
    turn,
)

KV_DTYPES = ["auto", "int8", "fp8", "int4"]


def test_turn_two_prefills_only_the_new_tokens(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    counter = ForwardCounter(engine)
    p1 = random_prompt(3 * BLOCK + 5, seed=11)
    o1 = turn(engine, "t1", p1, session="conv").output_token_ids or []
    user2 = random_prompt(23, seed=12)
    p2 = p1 + o1 + user2
    before_computed, before_forward = engine.stats.computed, counter.tokens
    out2 = turn(engine, "t2", p2, session="conv")
    # Pinned: p1 and all of o1 (its last token's KV was computed after turn 1 ended).
    pinned = len(p1) + len(o1)
    assert out2.num_cached_tokens == pinned
    assert engine.stats.computed - before_computed == len(p2) - pinned == len(user2)
    # The new tokens, NEW - 1 decode steps, and turn 2's own last token once it ended.
    assert counter.tokens - before_forward == len(user2) + (NEW - 1) + 1
    assert out2.output_token_ids == cold(path, p2)


def test_a_turn_sent_as_the_last_one_ends_starts_at_once(tiny_llama: tuple[Path, Any]) -> None:
    """The next turn of a session, added in the step its previous turn ended in (a client
    that answers at once), is not held back a step to pin the previous turn's last token:
    its own prefill computes that token with its new ones."""
    path, _ = tiny_llama
    engine = make_engine(path)
    counter = ForwardCounter(engine)
    p1 = random_prompt(2 * BLOCK + 3, seed=13)
    engine.add_request("t1", p1, GREEDY, session_id="conv")
    o1: list[int] | None = None
    while o1 is None:
        for out in engine.step():
            if out.finished:
                o1 = out.output_token_ids
    assert o1 is not None and len(o1) == NEW
    user2 = random_prompt(19, seed=14)
    p2 = p1 + o1 + user2
    engine.add_request("t2", p2, GREEDY, session_id="conv")
    before = counter.tokens
    first = engine.step()
    # t2 started in this very step: its first token is out, and the step ran o1's last
    # token and the new ones, nothing else.
    assert [o.request_id for o in first] == ["t2"] and first[0].num_output_tokens == 1
    assert counter.tokens - before == len(user2) + 1
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    assert final.num_cached_tokens == len(p1) + len(o1) - 1
    assert final.output_token_ids == cold(path, p2)


def test_divergence_mid_block_releases_only_what_follows(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path, enable_prefix_caching=False)
    p1 = random_prompt(4 * BLOCK, seed=21)
    turn(engine, "t1", p1, session="conv")
    session = engine.sessions.get("conv")
    assert session is not None
    held = len(session.kv.block_ids)
    # Regenerate: same history up to token 2 * BLOCK + 7, then something else.
    cut = 2 * BLOCK + 7
    p2 = p1[:cut] + random_prompt(9, seed=22)
    used_before = engine.block_pool.num_used_blocks
    assert used_before == held
    out = turn(engine, "t2", p2, session="conv")
    assert out.num_cached_tokens == cut
    assert engine.stats.cow_copies == 0  # the divergence block was the session's alone
    assert out.output_token_ids == cold(path, p2)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_divergence_inside_a_shared_block_copies_on_write(
    tiny_llama: tuple[Path, Any], kv_cache_dtype: str
) -> None:
    """Regenerate from the middle of a block the prefix cache holds: the block is copied, the
    copy extended, and the original stays intact for whoever finds it next."""
    path, _ = tiny_llama
    engine = make_engine(path, kv_cache_dtype=kv_cache_dtype)
    p1 = random_prompt(4 * BLOCK, seed=24)
    turn(engine, "t1", p1, session="conv")
    cut = 2 * BLOCK + 5  # inside the third block, which is full and registered
    p2 = p1[:cut] + random_prompt(9, seed=25)
    out = turn(engine, "t2", p2, session="conv")
    assert out.num_cached_tokens == cut
    assert engine.stats.cow_copies == 1
    assert out.output_token_ids == cold(path, p2, kv_cache_dtype)
    # The original block was not written: another session still finds all of p1's blocks.
    p3 = p1 + random_prompt(3, seed=26)
    again = turn(engine, "t3", p3, session="other")
    assert again.num_cached_tokens == 4 * BLOCK
    assert again.output_token_ids == cold(path, p3, kv_cache_dtype)


def test_shared_system_prompt_is_computed_once(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    system = random_prompt(4 * BLOCK + 3, seed=31)  # 4 full blocks shareable
    n = 5
    outs = [
        turn(engine, f"s{i}", system + random_prompt(10 + i, seed=40 + i), session=f"user{i}")
        for i in range(n)
    ]
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 4 * BLOCK for o in outs[1:])
    assert engine.stats.from_prefix_cache == (n - 1) * 4 * BLOCK
    # The shared blocks are held by every session at once, stored once.
    first_blocks = [engine.sessions.get(f"user{i}").kv.block_ids[:4] for i in range(n)]  # type: ignore[union-attr]
    assert all(b == first_blocks[0] for b in first_blocks)
    for block_id in first_blocks[0]:
        assert engine.block_pool.blocks[block_id].ref_count == n


def test_tenants_never_share_blocks(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    prompt = random_prompt(5 * BLOCK, seed=51)
    a = turn(engine, "a", prompt, session="a", salt="tenant-a")
    b = turn(engine, "b", prompt, session="b", salt="tenant-b")
    a2 = turn(engine, "a2", prompt, session="a-other", salt="tenant-a")
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 0  # same tokens, other tenant: no hit
    assert a2.num_cached_tokens == 5 * BLOCK - BLOCK  # same tenant: every full block but the last
    blocks_a = set(engine.sessions.get("a").kv.block_ids)  # type: ignore[union-attr]
    blocks_b = set(engine.sessions.get("b").kv.block_ids)  # type: ignore[union-attr]
    assert not blocks_a & blocks_b
    assert a.output_token_ids == b.output_token_ids == a2.output_token_ids


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_offloaded_session_restores_by_copy_with_identical_tokens(
    tiny_llama: tuple[Path, Any], kv_cache_dtype: str
) -> None:
    path, _ = tiny_llama
    # No prefix cache: freed device blocks cannot be found again, so the restore must copy.
    engine = make_engine(
        path,
        num_blocks=24,
        host_blocks=32,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    counter = ForwardCounter(engine)
    p1 = random_prompt(3 * BLOCK + 2, seed=61)
    o1 = turn(engine, "t1", p1, session="conv").output_token_ids or []
    evicted = engine.evict_session("conv")
    engine.step()  # commands run at the end of the next step; it answers with the session
    answer = evicted.result(timeout=0)
    assert answer.before is not None and answer.before.state is SessionState.RESIDENT
    assert answer.after is not None and answer.after.state is SessionState.OFFLOADED
    assert answer.after.num_device_blocks == 0
    assert answer.after.num_host_blocks == answer.before.num_device_blocks > 0
    # Another conversation now uses (and overwrites) the freed device blocks.
    turn(engine, "other", random_prompt(15 * BLOCK, seed=62), session="other")
    info = engine.session_info("conv")
    assert info is not None and info.state is SessionState.OFFLOADED
    p2 = p1 + o1 + random_prompt(7, seed=63)
    before, forwarded = engine.stats.computed, counter.tokens
    out = turn(engine, "t2", p2, session="conv")
    pinned = len(p1) + len(o1)
    assert engine.stats.from_host == pinned
    assert out.num_cached_tokens == pinned
    assert engine.stats.computed - before == len(p2) - pinned  # no recompute of history
    assert counter.tokens - forwarded == len(p2) - pinned + NEW - 1 + 1
    assert engine.stats.session_offloads == 1 and engine.stats.session_restores == 1
    assert out.output_token_ids == cold(path, p2, kv_cache_dtype)


def test_dropped_session_recomputes_with_identical_tokens(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path, enable_prefix_caching=False)
    p1 = random_prompt(2 * BLOCK + 9, seed=71)
    o1 = turn(engine, "t1", p1, session="conv").output_token_ids or []
    dropped = engine.evict_session("conv", offload=False)
    engine.step()
    after = dropped.result(timeout=0).after
    assert after is not None and after.state is SessionState.EMPTY and after.num_tokens == 0
    p2 = p1 + o1 + random_prompt(5, seed=72)
    out = turn(engine, "t2", p2, session="conv")
    assert engine.stats.session_drops == 1
    assert out.num_cached_tokens == 0
    assert out.output_token_ids == cold(path, p2)


def test_session_never_pins_more_than_its_budget(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    engine = make_engine(path, default_budget=SessionBudget(max_kv_tokens=40))
    p1 = random_prompt(5 * BLOCK, seed=81)
    o1 = turn(engine, "t1", p1, session="conv").output_token_ids or []
    info = engine.session_info("conv")
    assert info is not None
    assert info.num_tokens == 40 and info.num_device_blocks == 3  # ceil(40 / 16)
    # Budget exactly met on the next turn: 40 tokens reused, the rest computed.
    p2 = p1 + o1 + [5, 6, 7]
    assert turn(engine, "t2", p2, session="conv").num_cached_tokens == 40
    # A budget change applies at the next turn.
    engine.set_session_budget("conv", SessionBudget(max_kv_tokens=BLOCK))
    p3 = p2 + [8]
    turn(engine, "t3", p3, session="conv")
    info = engine.session_info("conv")
    assert info is not None and info.num_tokens == BLOCK and info.num_device_blocks == 1
    engine.set_session_budget("conv", SessionBudget(max_kv_tokens=0))
    turn(engine, "t4", p3 + [9], session="conv")
    info = engine.session_info("conv")
    assert info is not None and info.state is SessionState.EMPTY
    assert info.num_device_blocks == 0


PREEMPTION_CASES = [(0, "auto"), *((64, d) for d in KV_DTYPES)]


@pytest.mark.parametrize(
    ("host_blocks", "kv_cache_dtype"),
    PREEMPTION_CASES,
    ids=[f"{'swap' if h else 'recompute'}-{d}" for h, d in PREEMPTION_CASES],
)
def test_pool_too_small_for_the_batch_preempts_and_finishes_correctly(
    tiny_llama: tuple[Path, Any], host_blocks: int, kv_cache_dtype: str
) -> None:
    path, _ = tiny_llama
    prompts = [random_prompt(40 + 3 * i, seed=90 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    solo_engine = make_engine(path, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    solo = [
        turn(solo_engine, f"solo{i}", p, params=params).output_token_ids
        for i, p in enumerate(prompts)
    ]
    # Each request needs 6 blocks at its end; 4 of them need 24; the pool has 12.
    engine = make_engine(
        path, num_blocks=12, host_blocks=host_blocks, kv_cache_dtype=kv_cache_dtype
    )
    outs = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == solo
    preemptions = engine.stats.preemptions_swap + engine.stats.preemptions_recompute
    assert preemptions > 0
    if host_blocks:
        assert engine.stats.preemptions_swap > 0
    else:
        assert engine.stats.preemptions_recompute > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert engine.host_pool.num_free_blocks == engine.host_pool.num_blocks


def test_idle_sessions_are_evicted_before_running_requests_suffer(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path, num_blocks=16, enable_prefix_caching=False)
    for i in range(3):  # three idle sessions of 4 blocks each pin 12 of 16 blocks
        turn(
            engine,
            f"idle{i}",
            random_prompt(3 * BLOCK + 3, seed=100 + i),
            session=f"idle{i}",
            params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
    assert engine.sessions.num_resident == 3
    big = random_prompt(10 * BLOCK, seed=110)
    out = turn(engine, "big", big)
    assert out.output_token_ids == cold(path, big)
    assert engine.stats.preemptions_swap + engine.stats.preemptions_recompute == 0
    # The coldest sessions went first.
    infos = [engine.session_info(f"idle{i}") for i in range(3)]
    states = [info.state if info is not None else None for info in infos]
    assert states[0] is SessionState.EMPTY and states.count(SessionState.EMPTY) >= 2


def test_shared_system_prompt_arriving_together_is_computed_once(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    system = random_prompt(5 * BLOCK, seed=120)
    prompts = [system + random_prompt(7 + i, seed=121 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY, session_id=f"s{i}")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    # The first computes the system prompt; the others wait one step and hit its blocks.
    assert engine.stats.from_prefix_cache == 3 * 5 * BLOCK
    assert engine.stats.computed == sum(len(p) for p in prompts) - 3 * 5 * BLOCK
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].output_token_ids == cold(path, p)
