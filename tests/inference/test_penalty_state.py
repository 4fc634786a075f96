"""PenaltyState, updated one token a step, against the whole-history reference
(apply_penalties_reference) on fresh random inputs over many steps: repeated tokens, ids at and
past the vocabulary's edges, every mix of knobs, rows without any, -inf (masked) and zero
logits, the vectors written through numpy views (the CPU's way) or through torch (another
device's); an update missed or repeated; and the engine's own states through preemption
(recompute and swap), choices of one prompt, a grammar-constrained row and a session's next
turn."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model import penalty_state
from kvchat.inference.model.config import ModelConfig
from kvchat.inference.model.penalties import (
    apply_penalties_reference,
    apply_penalty_states,
)
from kvchat.inference.model.penalty_state import PenaltyState
from kvchat.inference.model.sampler import Sampler
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.structured.grammar import json_object_grammar
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_spec import KVCacheSpec
from kvchat_testing.engines import make_engine

# Float rounding between the two, relative to the logit: the reference subtracts the frequency
# penalty once per occurrence, the state f * count at once (each rounding is 6e-8 of the
# logit, the reference's at most ~50 of them here). Every knob drawn below is 0 or at least
# 0.25 away from it and the logits stay below ~500, so a token counted once too often or too
# rarely, or a repetition penalty missed, is off by far more.
TOLERANCE = 1e-4


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Any mix of the knobs, none of them included."""
    bias: tuple[tuple[int, float], ...] = ()
    if rng.random() < 0.4:
        ids = rng.sample(range(vocab), min(vocab, rng.randint(1, 6)))
        bias = tuple((t, rng.choice([-100.0, -2.5, 0.75, 30.0])) for t in ids)
    return SamplingParams(
        repetition_penalty=rng.choice([1.0, 1.0, 0.5, 0.8, 1.3, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.0, -1.5, -0.25, 0.5, 2.0]),
        presence_penalty=rng.choice([0.0, 0.0, -2.0, 0.25, 1.0]),
        logit_bias=bias,
    )


def random_token(rng: random.Random, vocab: int, pool: list[int]) -> int:
    """Mostly a repeat (a small pool), often a vocabulary edge, sometimes anything."""
    kind = rng.random()
    if kind < 0.6:
        return rng.choice(pool)
    if kind < 0.8:
        return rng.choice([0, vocab - 1])
    return rng.randrange(vocab)


def random_logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[torch.rand(rows, vocab, generator=gen) < 0.1] = 0.0
    logits[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")  # a grammar's mask
    return logits


def mismatch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[PenaltyState | None],
    histories: list[list[int]],
    num_prompt: list[int],
) -> float:
    """How far the states' penalized logits are from the reference's over the histories,
    relative to the logit (|got - expected| / max(1, |expected|)); inf where the two disagree
    on which logits are infinite, or differ at all in a row that counts no token (repetition
    and bias only: nothing rounds differently there)."""
    got = apply_penalty_states(logits, states)
    expected = apply_penalties_reference(logits, params, histories, num_prompt)
    finite = expected.isfinite()
    if not torch.equal(finite, got.isfinite()) or not torch.equal(got[~finite], expected[~finite]):
        return float("inf")
    relative = ((got - expected) / expected.abs().clamp(min=1.0)).abs()
    worst = 0.0
    for i, p in enumerate(params):
        diff = relative[i][finite[i]].max().item() if finite[i].any() else 0.0
        if not (p.frequency_penalty or p.presence_penalty) and diff:
            return float("inf")  # no count to round: must be exact
        worst = max(worst, diff)
    return worst


def assert_holds(state: PenaltyState, history: list[int], num_prompt: int, vocab: int) -> None:
    """The state's vectors are exactly the history's (clamped into the vocabulary): r at every
    id seen and 1 at the others; at every id generated c times -(f * c + p) and 0 at the
    others; and the counts of the ids generated."""
    clamped = [min(max(t, 0), vocab - 1) for t in history]
    output = Counter(clamped[num_prompt:])
    if state.is_repeated:
        expected = torch.ones(vocab)
        expected[sorted(set(clamped))] = state.repetition_penalty
        assert state.repetition is not None and torch.equal(state.repetition, expected)
    else:
        assert state.repetition is None
    if state.is_counted:
        assert state.counts == dict(output)
        expected = torch.zeros(vocab)
        for t, c in output.items():
            expected[t] = -(state.frequency_penalty * c + state.presence_penalty)
        assert state.offsets is not None and torch.equal(state.offsets, expected)
    else:
        assert state.offsets is None and not state.counts
    assert state.num_tokens == len(history)


@pytest.fixture(params=["numpy", "torch"])
def writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the states write their vectors: through numpy views (the CPU's way) or through
    torch (any other device's, run here on the CPU)."""
    if request.param == "torch":
        monkeypatch.setattr(penalty_state, "writes_on_host", lambda device: False)
    return str(request.param)


@pytest.mark.parametrize("vocab", [2, 7, 64, 5000])
def test_state_updated_each_step_matches_the_whole_history(vocab: int, writes: str) -> None:
    seed = random.randrange(2**32)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = 10
    params = [random_params(rng, vocab) for _ in range(rows)]
    params[0] = SamplingParams()  # a row without knobs
    params[1] = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    params[2] = SamplingParams(repetition_penalty=0.7)  # over the prompt and the output
    params[3] = SamplingParams(frequency_penalty=-0.5, logit_bias=((vocab - 1, 2.0),))
    pools = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(rows)]
    histories = []
    for i in range(rows):
        n = rng.choice([1, 2, 5, 40])
        prompt = [random_token(rng, vocab, pools[i]) for _ in range(n)]
        if rng.random() < 0.3:
            prompt[rng.randrange(n)] = vocab + rng.choice([0, 3])  # past the edge: clamped
        histories.append(prompt)
    num_prompt = [len(h) for h in histories]
    states = [
        PenaltyState(p, vocab, n) if p.has_penalties else None for p, n in zip(params, num_prompt)
    ]
    for step in range(80):
        for state, history in zip(states, histories):
            if state is not None:
                state.update(history)
        logits = random_logits(gen, rows, vocab)
        worst = mismatch(logits, params, states, histories, num_prompt)
        assert worst <= TOLERANCE, (seed, step, worst)
        for i, state in enumerate(states):
            if state is not None:
                assert_holds(state, histories[i], num_prompt[i], vocab)
        for i in range(rows):
            histories[i].append(random_token(rng, vocab, pools[i]))
    assert states[0] is None
    assert states[1] is not None and max(states[1].counts.values()) > 1  # repeats were counted


def test_no_state_is_the_same_tensor_and_a_bias_only_state_tracks_nothing() -> None:
    logits = torch.randn(2, 10)
    assert apply_penalty_states(logits, [None, None]) is logits
    state = PenaltyState.of(SamplingParams(logit_bias=((3, 1.0),)), [3, 3, 4], 1, 10)
    assert state.repetition is None and state.offsets is None and not state.counts
    assert state.num_tokens == 3
    got = apply_penalty_states(logits, [None, state])
    assert torch.equal(got[0], logits[0])
    assert got[1, 3] == logits[1, 3] + 1.0
    assert torch.equal(got[1, :3], logits[1, :3]) and torch.equal(got[1, 4:], logits[1, 4:])


def test_an_update_repeated_or_missed_changes_nothing(writes: str) -> None:
    seed = random.randrange(2**32)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    vocab = 50
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.5)
    history = [rng.randrange(vocab) for _ in range(20)]
    state = PenaltyState.of(params, history, 20, vocab)
    for step in range(30):
        history.append(rng.choice([1, 2, 3, rng.randrange(vocab)]))
        if step % 3 == 0:
            continue  # a missed step: the next update takes both tokens in
        state.update(history)
        state.update(history)  # again: nothing new
        assert_holds(state, history, 20, vocab)
        logits = random_logits(gen, 1, vocab)
        assert mismatch(logits, [params], [state], [history], [20]) <= TOLERANCE, seed


def test_the_comparison_catches_a_token_counted_twice_or_not_at_all() -> None:
    """The check the tests above rest on fails for a state one token off its history."""
    vocab = 30
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    history = [1, 2, 3, 4, 5, 6, 5, 5]
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) + 5.0
    good = PenaltyState.of(params, history, 5, vocab)
    assert mismatch(logits, [params], [good], [history], [5]) <= TOLERANCE
    doubled = PenaltyState.of(params, [*history, history[-1]], 5, vocab)
    skipped = PenaltyState.of(params, history[:-1], 5, vocab)
    new_token_skipped = PenaltyState.of(params, [*history[:-1], 7], 5, vocab)
    for wrong in (doubled, skipped, new_token_skipped):
        assert mismatch(logits, [params], [wrong], [history], [5]) > 10 * TOLERANCE


@pytest.mark.parametrize("repetition", [0.6, 1.0, 1.7])
def test_the_sampler_with_states_samples_as_from_the_reference_logits(repetition: float) -> None:
    """Greedy, seeded and grammar-checked or -masked rows: the same tokens from the states as
    from logits the reference penalized."""
    seed = random.randrange(2**32)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    vocab, rows = 300, 6
    params = [
        SamplingParams(
            temperature=t,
            seed=i,
            top_k=k,
            repetition_penalty=repetition,
            frequency_penalty=0.5,
            presence_penalty=1.0,
            logit_bias=((5, 3.0),),
        )
        for i, (t, k) in enumerate([(0.0, None), (1.0, None), (0.7, 20)] * 2)
    ]
    histories = [[rng.randrange(40) for _ in range(rng.randint(1, 60))] for _ in range(rows)]
    num_prompt = [max(1, len(h) // 2) for h in histories]
    states = [PenaltyState.of(p, h, n, vocab) for p, h, n in zip(params, histories, num_prompt)]
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[:, :40] = True  # the grammar allows the tokens seen: the penalties decide
    grammar = _Grammar(allowed, rows=[3, 4, 5])
    logits = torch.randn(rows, vocab, generator=gen) * 3
    reference = apply_penalties_reference(logits, params, histories, num_prompt)
    plain = [SamplingParams(temperature=p.temperature, seed=p.seed, top_k=p.top_k) for p in params]

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(100 + i) for i in range(rows)]

    got = Sampler(seed=0)(logits, params, generators(), grammar=grammar, penalties=states)
    want = Sampler(seed=0)(reference, plain, generators(), grammar=grammar)
    assert got.token_ids == want.token_ids, seed
    assert all(allowed[r, got.token_ids[r]] for r in grammar.rows)


class _Grammar:
    """RowGrammars over fixed allowed-token masks ([N, V] bool)."""

    def __init__(self, allowed: torch.Tensor, rows: list[int]) -> None:
        self.allowed = allowed
        self.rows = rows
        self.mask_first: frozenset[int] = frozenset()

    def allows(self, row: int, token: int) -> bool:
        return bool(self.allowed[row, token])

    def offsets(self, rows: list[int], num_rows: int | None = None) -> torch.Tensor:
        masked = torch.zeros(len(rows), self.allowed.shape[1]).masked_fill(
            ~self.allowed[rows], float("-inf")
        )
        if num_rows is None:
            return masked
        out = torch.zeros(num_rows, self.allowed.shape[1])
        out[rows] = masked
        return out


class _CheckedSampler:
    """The engine's sampler, first checking that the penalty states it is given penalize as
    their sequences' whole histories do (the running sequence each state belongs to)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sampler = engine.sampler
        self.worst = 0.0
        self.rows_checked = 0

    def __call__(self, logits: torch.Tensor, params: Any, generators: Any, **kw: Any) -> Any:
        states = kw["penalties"]
        owner = {
            id(s.penalty_state): s
            for s in self.engine.scheduler.running
            if s.penalty_state is not None
        }
        seqs = [None if st is None else owner[id(st)] for st in states]
        histories = [[] if s is None else list(s.token_ids) for s in seqs]
        num_prompt = [0 if s is None else s.num_prompt_tokens for s in seqs]
        worst = mismatch(logits, list(params), list(states), histories, num_prompt)
        self.worst = max(self.worst, worst)
        for state, history, n in zip(states, histories, num_prompt):
            if state is not None:
                assert_holds(state, history, n, logits.shape[1])
                self.rows_checked += 1
        return self.sampler(logits, params, generators, **kw)


def checked(engine: Engine) -> _CheckedSampler:
    spy = _CheckedSampler(engine)
    engine.sampler = spy  # type: ignore[assignment]
    return spy


def batch_params() -> list[SamplingParams]:
    knobs: dict[str, Any] = dict(
        repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, max_tokens=40
    )
    return [
        SamplingParams(temperature=0.0, ignore_eos=True, logit_bias=((220, -5.0),), **knobs),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),  # no knobs
        # two choices of one prompt: one state each
        SamplingParams(temperature=1.0, seed=1, ignore_eos=True, **knobs),
        SamplingParams(temperature=1.0, seed=2, ignore_eos=True, **knobs),
        SamplingParams(
            temperature=1.0,
            seed=3,
            grammar=json_object_grammar(),
            **{**knobs, "repetition_penalty": 0.8},
        ),
    ]


def engine_with(model: Path, num_blocks: int, host_blocks: int) -> Engine:
    """A float32 CPU engine with `num_blocks` KV blocks of 16 and room for `host_blocks` on
    the host (swap)."""
    config = ModelConfig.from_dir(model)
    spec = KVCacheSpec(
        config.num_layers, config.num_kv_heads, config.head_dim, 16, torch.float32, "auto"
    )
    return Engine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(
                block_size=16,
                num_blocks_override=num_blocks,
                host_cache_bytes=host_blocks * spec.bytes_per_block,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        )
    )


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
def test_the_engines_states_follow_their_sequences_through_preemption(
    dev_model: Path, host_blocks: int
) -> None:
    rng = np.random.default_rng(random.randrange(2**32))
    prompts = [rng.integers(0, 5000, 30).tolist() for _ in range(4)]
    prompts.insert(3, prompts[2])  # the second choice
    params = batch_params()
    ample = engine_with(dev_model, 256, 0)
    ample_spy = checked(ample)
    reference = ample.generate(prompts, params)
    assert ample.stats.preemptions_swap + ample.stats.preemptions_recompute == 0
    # 5 requests of 70 tokens need 5 blocks of 16 each at their end, 25 in all: 9 are there.
    engine = engine_with(dev_model, 9, host_blocks)
    spy = checked(engine)
    outs = engine.generate(prompts, params)
    if host_blocks:
        assert engine.stats.preemptions_swap > 0
    else:
        assert engine.stats.preemptions_recompute > 0
    for out, expected in zip(outs, reference):
        assert out.output_token_ids == expected.output_token_ids
    for s in (ample_spy, spy):
        assert s.worst <= TOLERANCE
        assert s.rows_checked >= 3 * 40  # three rows run all their 40 steps


def test_a_sessions_next_turn_builds_its_state_from_the_whole_history(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    engine = make_engine(path)
    spy = checked(engine)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        repetition_penalty=1.5,
        presence_penalty=1.0,
    )
    rng = np.random.default_rng(random.randrange(2**32))
    first_ids = rng.integers(0, 512, 40).tolist()
    engine.add_request("t1", first_ids, params, session_id="s")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (first,) = outputs
    assert first.output_token_ids is not None
    second_ids = first_ids + first.output_token_ids + rng.integers(0, 512, 10).tolist()
    engine.add_request("t2", second_ids, params, session_id="s")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (second,) = outputs
    assert second.num_cached_tokens >= len(first_ids)
    assert spy.worst <= TOLERANCE and spy.rows_checked == 2 * 12
    (alone,) = make_engine(path).generate([second_ids], params)
    assert second.output_token_ids == alone.output_token_ids
