"""Constrained decoding in the engine, on the random-weight dev model (cl100k vocab): only a
constraint makes its output valid. A constrained row never changes another row's tokens;
seeded sampling stays reproducible; the grammar state survives preemption (recompute and
swap) and session reuse; a length limit ends a structure early without error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import kvchat.inference.structured.output as structured_output
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.request_output import RequestOutput
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.errors import InvalidRequestError
from kvchat.inference.model.config import ModelConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.structured.grammar import (
    Grammar,
    ToolSpec,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from kvchat.inference.text.tool_calls import HERMES
from kvchat.memory.config import CacheConfig
from kvchat.memory.kv_spec import KVCacheSpec

BLOCK = 16
# Bounded, so a random model closes every structure within a few dozen tokens.
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50},
        "label": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["x", "label", "tags"],
    "additionalProperties": False,
}
FLAGS = {
    "type": "object",
    "properties": {
        "on": {"type": "boolean"},
        "level": {"type": "number", "minimum": 0, "maximum": 4, "multipleOf": 0.5},
    },
    "required": ["on", "level"],
    "additionalProperties": False,
}
# Long enough to outgrow a small pool: six strings of exactly 8 characters.
LIST = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {"type": "string", "minLength": 8, "maxLength": 8},
        }
    },
    "required": ["words"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvchat.inference.model.dev_model import init_model

    path = tmp_path_factory.mktemp("models") / "dev"
    init_model(path, "dev", seed=3)
    return path


def make_engine(path: Path, num_blocks: int = 256, host_blocks: int = 0, **cache: Any) -> Engine:
    config = ModelConfig.from_dir(path)
    spec = KVCacheSpec(
        config.num_layers, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "auto"
    )
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(
                block_size=BLOCK,
                num_blocks_override=num_blocks,
                host_cache_bytes=host_blocks * spec.bytes_per_block,
                **cache,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        )
    )


@pytest.fixture(scope="module")
def engine(dev_model: Path) -> Engine:
    return make_engine(dev_model)


def prompt(engine: Engine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", allow_special=True
    )


def constrained(grammar: Grammar, seed: int, max_tokens: int = 120, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, grammar=grammar, **kw)


def check_json(engine: Engine, out: RequestOutput, schema: dict[str, Any]) -> Any:
    assert out.finish_reason == "stop", out.text
    assert out.output_token_ids and out.output_token_ids[-1] not in engine.eos_token_ids
    value = json.loads(out.text or "")
    jsonschema.validate(value, schema)
    return value


def turn(
    engine: Engine, rid: str, ids: list[int], params: SamplingParams, session: str | None = None
) -> RequestOutput:
    engine.add_request(rid, ids, params, session_id=session)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    assert final is not None
    return final


def test_unconstrained_row_gets_its_solo_tokens_next_to_constrained_ones(engine: Engine) -> None:
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = prompt(engine, "Describe a point.")
    solo_free, solo_greedy = (engine.generate([ids], p)[0].output_token_ids for p in (free, greedy))
    solo_point = engine.generate([ids], constrained(json_schema_grammar(POINT), seed=5))[0]
    outs = engine.generate(
        [ids, ids, ids, ids],
        [
            constrained(json_schema_grammar(POINT), seed=5),
            free,
            constrained(json_schema_grammar(FLAGS), seed=6),
            greedy,
        ],
    )
    assert outs[1].output_token_ids == solo_free
    assert outs[3].output_token_ids == solo_greedy
    # The constrained rows: valid, each for its own schema, and the same as alone.
    assert check_json(engine, outs[0], POINT) == check_json(engine, solo_point, POINT)
    assert outs[0].output_token_ids == solo_point.output_token_ids
    check_json(engine, outs[2], FLAGS)
    # Unconstrained, the same seed writes no JSON at all: the constraint did the work.
    with pytest.raises(json.JSONDecodeError):
        json.loads(engine.generate([ids], SamplingParams(max_tokens=40, seed=5))[0].text or "")


NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 30, "maxLength": 80}},
    "required": ["note"],
    "additionalProperties": False,
}


def test_checked_draws_and_mask_placement_never_change_the_tokens(
    dev_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constrained rows are checked first (their masks computed only when all draws are
    rejected, and taken first for a few steps after), or masked first (top-k); masks taken
    first are computed beside the forward or after it. None of it changes a seeded
    request's tokens, alone or batched."""
    ids = prompt(make_engine(dev_model), "Points, flags, a note and a call.")
    call = tool_call_grammar([ToolSpec("set_flags", FLAGS)], HERMES, parallel=False)
    params = [
        constrained(json_schema_grammar(POINT), seed=7),
        SamplingParams(max_tokens=30, temperature=1.0, seed=8, ignore_eos=True),
        constrained(json_schema_grammar(FLAGS), seed=9),
        constrained(call, seed=10),  # forced text: the tag, the name, the keys
        SamplingParams(max_tokens=80, temperature=0.0, grammar=json_schema_grammar(POINT)),
        constrained(json_schema_grammar(FLAGS), seed=11, top_k=5),  # always masked first
        constrained(json_schema_grammar(NOTE), seed=12, max_tokens=100),
    ]  # checks pass
    tokens, masked = {}, {}
    for placement, worker_min in (("beside", 0.0), ("after", float("inf"))):
        monkeypatch.setattr(structured_output, "MASK_WORKER_MIN_SECONDS", worker_min)
        engine = make_engine(dev_model)
        # Decide by the expected mask time, as on a full machine.
        engine.structured_output.spare_core = False
        rows = [0]
        fill = engine.grammars.fill_bitmask

        def counting(matchers: Any, *args: Any, fill: Any = fill, rows: list[int] = rows) -> Any:
            rows[0] += len(matchers)
            return fill(matchers, *args)

        monkeypatch.setattr(engine.grammars, "fill_bitmask", counting)
        outs = engine.generate([ids] * len(params), params)
        assert (engine.structured_output.mask_worker is not None) == (placement == "beside")
        for i, schema in ((0, POINT), (2, FLAGS), (4, POINT), (5, FLAGS), (6, NOTE)):
            check_json(engine, outs[i], schema)
        assert outs[3].text and outs[3].text.startswith('<tool_call>\n{"name": "set_flags"')
        tokens[placement] = [o.output_token_ids for o in outs]
        masked[placement] = rows[0]
        # Each seeded constrained request alone: the same tokens.
        for i in (0, 3, 6):
            alone = make_engine(dev_model).generate([ids], params[i])[0]
            assert alone.output_token_ids == tokens[placement][i]
    assert tokens["beside"] == tokens["after"]
    assert masked["beside"] == masked["after"]
    # Fewer masks than constrained row-steps: checks passed (inside the note's string most
    # tokens are allowed), though the random model's draws mostly miss elsewhere.
    steps = sum(len(t or ()) for t in tokens["after"]) - len(tokens["after"][1] or ())
    assert len(tokens["after"][5] or ()) < masked["after"] < steps


def test_without_checks_first_every_constrained_step_computes_a_mask(
    dev_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCHAT_GRAMMAR_CHECKS_FIRST", "false")
    from kvchat.app.settings import Settings

    config = Settings(model=dev_model).engine_config()
    assert config.grammar_checks_first is False
    engine = Engine(config)
    rows = [0]
    fill = engine.grammars.fill_bitmask

    def counting(matchers: Any, *args: Any) -> Any:
        rows[0] += len(matchers)
        return fill(matchers, *args)

    monkeypatch.setattr(engine.grammars, "fill_bitmask", counting)
    ids = prompt(engine, "A note.")
    outs = engine.generate(
        [ids] * 2, [constrained(json_schema_grammar(NOTE), seed=s, max_tokens=100) for s in (1, 2)]
    )
    for out in outs:
        check_json(engine, out, NOTE)
    # A mask for every token (the request ends with the object's last token).
    assert rows[0] == sum(len(o.output_token_ids or ()) for o in outs)


def test_seeds_reproduce_and_differ(engine: Engine) -> None:
    ids = prompt(engine, "Flags?")
    grammar = json_schema_grammar(POINT)
    outs = engine.generate([ids] * 6, [constrained(grammar, seed=s) for s in (1, 1, 2, 3, 4, 5)])
    values = [check_json(engine, o, POINT) for o in outs]
    assert outs[0].output_token_ids == outs[1].output_token_ids
    assert len({json.dumps(v) for v in values[1:]}) >= 4


def test_greedy_constrained_decoding_is_valid(engine: Engine) -> None:
    out = engine.generate(
        [prompt(engine, "Point?")],
        SamplingParams(max_tokens=120, temperature=0.0, grammar=json_schema_grammar(POINT)),
    )[0]
    check_json(engine, out, POINT)


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_length_before_the_structure_closes_ends_with_length(
    engine: Engine, max_tokens: int
) -> None:
    grammar = json_schema_grammar(LIST)
    out = engine.generate([prompt(engine, "Words?")], constrained(grammar, 3, max_tokens))[0]
    assert out.finish_reason == "length"
    assert out.output_token_ids is not None and len(out.output_token_ids) == max_tokens
    # What was produced is a prefix the grammar accepts.
    matcher = engine.grammars.new_matcher(grammar)
    assert matcher.consume_tokens(out.output_token_ids) and not matcher.is_accepting()
    assert (out.text or "").startswith("{")


def test_json_object_output_is_an_accepted_prefix_or_an_object(engine: Engine) -> None:
    grammar = json_object_grammar()
    outs = engine.generate(
        [prompt(engine, "Any object")] * 4,
        [constrained(grammar, s, max_tokens=30) for s in range(4)],
    )
    for out in outs:
        assert out.output_token_ids
        matcher = engine.grammars.new_matcher(grammar)
        assert matcher.consume_tokens(out.output_token_ids)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text or ""), dict)
        else:
            assert out.finish_reason == "length" and (out.text or "").startswith("{")


def test_a_grammar_that_does_not_compile_is_a_request_error(engine: Engine) -> None:
    bad = json_schema_grammar({"type": "array", "uniqueItems": True})
    with pytest.raises(InvalidRequestError, match="uniqueItems") as info:
        engine.add_request("bad", prompt(engine, "x"), constrained(bad, 1))
    assert info.value.field == "grammar"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
def test_grammar_state_survives_preemption(dev_model: Path, host_blocks: int) -> None:
    ample = make_engine(dev_model, enable_prefix_caching=False)
    ids = [prompt(ample, f"List {i} words " + "please " * 30) for i in range(4)]
    grammar = json_schema_grammar(LIST)
    params = [constrained(grammar, seed=20 + i, max_tokens=200) for i in range(4)]
    # The same batch with room for all (batching changes no row: tested above) ...
    reference = ample.generate(ids, params)
    assert ample.stats.preemptions_swap + ample.stats.preemptions_recompute == 0
    # ... and in a pool of 9 blocks: each request needs 5 at its end, the 4 of them 20.
    engine = make_engine(dev_model, num_blocks=9, host_blocks=host_blocks)
    outs = engine.generate(ids, params)
    if host_blocks:
        assert engine.stats.preemptions_swap > 0
    else:
        assert engine.stats.preemptions_recompute > 0
    for out, expected in zip(outs, reference):
        assert out.output_token_ids == expected.output_token_ids
        check_json(engine, out, LIST)


def test_a_session_turn_starts_its_own_grammar_on_the_reused_kv(dev_model: Path) -> None:
    engine = make_engine(dev_model)
    first_ids = prompt(engine, "First point")
    first = turn(engine, "t1", first_ids, constrained(json_schema_grammar(POINT), 7), "s")
    check_json(engine, first, POINT)
    assert first.output_token_ids is not None
    second_ids = first_ids + first.output_token_ids + prompt(engine, "Now flags")
    params = constrained(json_schema_grammar(FLAGS), 8)
    second = turn(engine, "t2", second_ids, params, "s")
    assert second.num_cached_tokens >= len(first_ids)
    check_json(engine, second, FLAGS)
    cold = turn(make_engine(dev_model, enable_prefix_caching=False), "cold", second_ids, params)
    assert second.output_token_ids == cold.output_token_ids


def test_logprobs_of_a_constrained_request_are_over_the_allowed_tokens(engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=3,
        temperature=1.0,
        seed=2,
        logprobs=True,
        top_logprobs=5,
        grammar=json_schema_grammar(POINT),
    )
    engine.add_request("lp", prompt(engine, "Point"), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "lp"]
    first = next(o for o in outs if o.new_token_ids)
    assert first.new_top_logprobs is not None and first.new_logprobs is not None
    (top,) = first.new_top_logprobs
    assert engine.tokenizer is not None
    # Only '{"' (or '{') may start this object: fewer than 5 alternatives, all the mass.
    assert '{"' in {engine.tokenizer.decode([t]) for t, _ in top}
    assert {engine.tokenizer.decode([t]) for t, _ in top} <= {"{", '{"'}
    assert abs(sum(torch.tensor([v for _, v in top]).exp().tolist()) - 1.0) < 1e-4
    assert first.new_logprobs[0] in [v for _, v in top]
