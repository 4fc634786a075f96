"""History planning on the real engine: long conversations under a context budget keep their
pinned KV between trim events; summaries run as background work."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvchat.history import (
    HistoryPolicy,
    SummaryState,
    end_at_sentence,
    facts,
    missing_facts,
)
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.chat_template import ChatMessage, load_chat_template
from kvchat.inference.text.context_builder import SUMMARY_PREFIX, ContextBuilder
from kvchat.inference.text.conversation import Conversation, TurnResult
from kvchat.memory.config import CacheConfig, SessionBudget

# A tight budget and short turns: the conversation is several times the budget after 48 turns
# of ~21 tokens, `drop` trims about every 4 turns, and each turn is one prefill step (the
# token budget holds a whole prompt) plus three decode steps.
REPLY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BUDGET = 256
NUM_TURNS = 48
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kettle",
    "orbit",
    "lantern",
    "river",
    "copper",
    "maple",
    "quartz",
    "velvet",
    "harbor",
    "pixel",
    "summit",
    "tundra",
    "willow",
    "zephyr",
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The model is tiny: one intra-op thread computes a step as fast as two on a quiet
    machine, and on a busy one two threads wait on each other at every op (6x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dev_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvchat.inference.model.dev_model import init_model

    path = tmp_path_factory.mktemp("dev")
    init_model(path, "dev", seed=4)
    return path


def make_engine(path: Path, budget: int = BUDGET) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=16, num_blocks_override=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        )
    )


def conversation(engine: Engine, policy: HistoryPolicy, session: str = "conv") -> Conversation:
    assert engine.tokenizer is not None
    template = load_chat_template(engine.config.model, engine.tokenizer)
    engine.set_session_budget(session, SessionBudget(max_context_tokens=BUDGET))
    return Conversation(
        engine,
        ContextBuilder(template, engine.tokenizer),
        session,
        system="You are a terse assistant.",
        policy=policy,
    )


def user_text(rng: random.Random, num_words: tuple[int, int] = (4, 10)) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*num_words)))


def run_turns(path: Path, policy: str) -> tuple[Conversation, list[TurnResult], int]:
    engine = make_engine(path)
    conv = conversation(engine, HistoryPolicy(policy=policy))
    rng = random.Random(0)
    computed_before = engine.stats.computed
    results = [conv.turn(user_text(rng), REPLY) for _ in range(NUM_TURNS)]
    total_history = sum(c.num_tokens for c in conv.counts.values())
    assert total_history > 4 * BUDGET  # the conversation is several times the budget
    return conv, results, engine.stats.computed - computed_before


def test_watermarks_keep_the_cache_warm_over_many_trims(dev_model: Path) -> None:
    runs = {policy: run_turns(dev_model, policy) for policy in ("drop", "drop_oldest")}
    prefill = {policy: computed for policy, (_, _, computed) in runs.items()}
    trims = {
        policy: sum(r.plan.trimmed for r in results) for policy, (_, results, _) in runs.items()
    }
    print(f"\nprefill tokens computed: {prefill}; trim events: {trims}")
    # Every token the engine computed is one a turn's prompt did not find in the cache.
    for _, results, computed in runs.values():
        assert computed == sum(len(r.prompt_ids) - r.output.num_cached_tokens for r in results)
    # drop_oldest moves the prefix nearly every turn once the window is full and prefills it
    # again; the watermarks move it about once every four turns.
    assert trims["drop"] >= 8
    assert trims["drop_oldest"] >= 3 * trims["drop"]
    assert prefill["drop_oldest"] >= 3 * prefill["drop"]

    conv, results, _ = runs["drop"]
    counters = conv.history_stats
    assert counters.trims == trims["drop"] > 0
    assert counters.dropped_tokens == sum(r.plan.num_dropped_tokens for r in results)
    max_tokens = REPLY.max_tokens
    assert max_tokens is not None
    low = conv.policy.low_watermark_tokens(BUDGET)
    for before, after in itertools.pairwise(results):
        assert after.plan.num_prompt_tokens + max_tokens <= BUDGET
        if after.plan.trimmed:
            # A trim event cuts back to the low watermark, leaving room for the next turns.
            assert after.plan.num_prompt_tokens + max_tokens <= low
            continue
        # Between trim events the prompt extends the last one: its prompt and every token it
        # generated come from the session; only the new message is prefilled (with the last
        # generated token, when the next turn was sent before a step could pin it).
        reused = len(before.prompt_ids) + len(before.output.output_token_ids)
        assert after.prompt_ids[:reused] == before.prompt_ids + before.output.output_token_ids
        assert reused - 1 <= after.output.num_cached_tokens <= reused


def test_summary_runs_in_the_background_and_reaches_a_later_prompt(dev_model: Path) -> None:
    engine = make_engine(dev_model, budget=48)
    conv = conversation(engine, HistoryPolicy(policy="summarize", max_summary_tokens=24))
    # Random weights, greedy, write blank lines or stop at once; sampled, they write text.
    conv.summary_params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    other = conversation(engine, HistoryPolicy(policy="drop"), session="other")
    rng = random.Random(1)
    # (summary running, steps to our first token, prefill tokens of both turns)
    steps_to_first_token: list[tuple[bool, int, int]] = []
    summary_seen_running_with = set()
    results = []
    for _ in range(40):
        # Another conversation's turn runs alongside (a normal-priority load).
        other_id, _, other_prompt = other.submit(user_text(rng), REPLY)
        request_id, plan, prompt = conv.submit(user_text(rng), REPLY)
        running_summary = conv.pending_summary is not None
        steps, final, first, other_done, other_final = 0, None, None, False, None
        while final is None or not other_done:
            outputs = engine.step()
            steps += 1
            for seq in engine.scheduler.running:
                if conv.pending_summary and seq.request_id == conv.pending_summary.request_id:
                    assert seq.priority > 0
                    summary_seen_running_with.update(
                        s.request_id for s in engine.scheduler.running if s is not seq
                    )
            for out in outputs:
                if out.request_id == request_id:
                    first = first or steps
                    if out.finished:
                        final = out
                elif out.request_id == other_id and out.finished:
                    other.finish_turn(out)
                    other_done, other_final = True, out
                else:
                    conv.on_output(out)
        conv.finish_turn(final)
        results.append((plan, prompt, final))
        conv.maybe_summarize(plan)
        # Both turns' prefill comes before our first token (the other was sent first).
        prefill = len(prompt) - final.num_cached_tokens
        prefill += len(other_prompt) - other_final.num_cached_tokens
        steps_to_first_token.append((running_summary, first, prefill))
        if len(conv.summaries) >= 2:
            break
    assert conv.summaries, "no summary was made"
    # It ran next to normal requests (the other conversation's turns and our own).
    assert summary_seen_running_with
    first = conv.summaries[0]
    # Stored with its range: exactly the messages dropped when it was asked for.
    trim_plan = next(p for p, _, _ in results if p.to_summarize)
    assert first.covers == trim_plan.to_summarize == trim_plan.dropped
    assert len(first.text) > 0
    # A later turn's prompt carries it right after the system prompt.
    later = next((p, ids) for p, ids, _ in results if p.summary is not None)
    assert later[0].summary.covers[: len(first.covers)] == first.covers
    assert engine.tokenizer is not None
    assert SUMMARY_PREFIX + later[0].summary.text in engine.tokenizer.decode(later[1])
    assert conv.history_stats.summaries == len(conv.summaries)
    # A user's turn never waits for the summary: its first token comes as many steps after
    # it is sent as the normal requests' prefill needs (token budget 48; +1 for the decode
    # step of the other turn), with a summary in flight or not.
    print("\n(summary running, steps to first token, prefill tokens):", steps_to_first_token)
    assert any(running for running, _, _ in steps_to_first_token)
    for _, steps, prefill in steps_to_first_token:
        assert steps <= -(-prefill // 48) + 1


def test_summaries_are_made_within_their_share_of_the_budget(dev_model: Path) -> None:
    # The default summary request (greedy, max_summary_tokens 512) is bounded so that the
    # summary as placed takes at most a quarter of the budget: 64 of 256 tokens.
    engine = make_engine(dev_model)
    conv = conversation(engine, HistoryPolicy(policy="summarize"))
    rng = random.Random(2)
    for _ in range(40):
        if conv.turn(user_text(rng), REPLY).summary_requested:
            break
    pending = conv.pending_summary
    assert pending is not None, "no trim event asked for a summary"
    markup = conv.builder.summary_state(conv.system, "", ()).num_tokens
    for step in range(200):  # a safety net: it ends within max_tokens steps
        for out in engine.step():
            conv.on_output(out)
        if step == 0:  # admitted by the first step
            queued = [*engine.scheduler.waiting, *engine.scheduler.running]
            request = next(s for s in queued if s.request_id == pending.request_id)
            assert request.params.max_tokens == BUDGET // 4 - markup
            assert request.params.max_tokens < conv.policy.max_summary_tokens
        if conv.pending_summary is None:
            break
    # (Greedy, random weights write blank lines: what lands is the extract.)
    assert conv.summary is not None and conv.summary.covers == pending.covers
    assert conv.summary.num_tokens <= BUDGET // 4


# -- running summaries keep what they claim to cover --------------------------------------------


def chat(*pairs: tuple[str, str]) -> list[tuple[str, ChatMessage]]:
    return [(f"m{i}", ChatMessage(role, content)) for i, (role, content) in enumerate(pairs)]


FACTS = chat(
    ("user", "My name is Ada Lovelace and I work as a nurse in Lyon."),
    ("assistant", "Nice to meet you, Ada."),
    ("user", "Since 2019. My friend Bruno lives in Porto."),
    ("assistant", "Porto is a lovely city."),
)


def covered_facts_missing(summary: SummaryState, messages: dict[str, ChatMessage]) -> list[str]:
    """The facts of the covered user messages that the summary's text does not state."""
    required = set().union(
        *(facts(messages[i].content or "") for i in summary.covers if messages[i].role == "user")
    )
    return missing_facts(summary.text, required)


def test_a_generated_summary_is_kept_only_when_it_keeps_the_facts(dev_model: Path) -> None:
    builder = conversation(make_engine(dev_model), HistoryPolicy(policy="summarize")).builder
    system = "You are a terse assistant."
    good = "Ada Lovelace is a nurse in Lyon since 2019; her friend Bruno lives in Porto."
    settled = builder.settle_summary(system, None, FACTS, good, False, 64)
    assert settled is not None and not settled.extracted and settled.defect is None
    assert settled.state.text == good and settled.state.covers == ("m0", "m1", "m2", "m3")
    assert settled.state.num_tokens == builder.summary_state(system, good, ()).num_tokens
    # Cut by its token limit: ended at its last whole sentence (which still keeps every fact).
    cut = builder.settle_summary(system, None, FACTS, good + " She asked about the", True, 64)
    assert cut is not None and cut.state.text == good and not cut.extracted
    # Ended early by the limit, the facts after the cut are lost: the summary is extracted.
    early = "Ada Lovelace is a nurse in Lyon. Her friend Bru"
    extracted = builder.settle_summary(system, None, FACTS, early, True, 64)
    assert extracted is not None and extracted.extracted
    assert extracted.defect == "leaves out 2019, Bruno, Porto"
    assert extracted.state.text == (
        "The user said: My name is Ada Lovelace and I work as a nurse in Lyon.\n"
        "The user said: Since 2019. My friend Bruno lives in Porto."
    )
    assert extracted.state.covers == ("m0", "m1", "m2", "m3")
    # The extract folds the previous summary in first, and covers what follows it.
    previous = SummaryState("The user is 41.", 9, ("p0", "p1"))
    more = builder.settle_summary(system, previous, FACTS[2:], None, False, 64)
    assert more is not None and more.extracted and more.defect is None
    assert (
        more.state.text
        == "The user is 41.\nThe user said: Since 2019. My friend Bruno lives in Porto."
    )
    assert more.state.covers == ("p0", "p1", "m2", "m3")


def test_an_extract_covers_only_the_messages_whose_facts_it_holds(dev_model: Path) -> None:
    builder = conversation(make_engine(dev_model), HistoryPolicy(policy="summarize")).builder
    system = "You are a terse assistant."
    first = builder.summary_state(system, "The user said: " + FACTS[0][1].content, ())
    # Room for the first message's line alone: the summary covers it (and the reply after
    # it) and stops before the message whose facts would not fit.
    settled = builder.settle_summary(system, None, FACTS, None, False, first.num_tokens + 2)
    assert settled is not None and settled.state.covers == ("m0", "m1")
    assert settled.state.num_tokens <= first.num_tokens + 2
    messages = dict(FACTS)
    assert covered_facts_missing(settled.state, messages) == []
    assert "Bruno" not in settled.state.text
    # A long message whose facts fit: its other sentences are left out, its facts kept.
    chatty = chat(
        ("user", "I grew up by the sea. " * 6 + "My sister Ines was born in 1987."),
    )
    room = builder.summary_state(system, "The user said: My sister Ines was born in 1987.", ())
    short = builder.settle_summary(system, None, chatty, None, False, room.num_tokens)
    assert (
        short is not None and short.state.text == "The user said: My sister Ines was born in 1987."
    )
    # Room is made by questions first (they were answered), then by other sentences that
    # state no fact, oldest first; the facts stay.
    previous = SummaryState("The user said: I work as a nurse. What is a good book?", 0, ("p0",))
    line = "The user said: My friend Bruno lives in Porto."
    text = "The user said: I work as a nurse.\n" + line
    fits = builder.summary_state(system, text, ()).num_tokens
    friend = chat(("user", "My friend Bruno lives in Porto."))
    made = builder.settle_summary(system, previous, friend, None, False, fits)
    assert made is not None and made.state.text == text
    made = builder.settle_summary(system, previous, friend, None, False, fits - 3)
    assert made is not None and made.state.text == line and made.state.covers == ("p0", "m0")
    # Nothing fits: no summary (the one before stays, and covers no more than it holds).
    assert builder.settle_summary(system, None, FACTS, None, False, 8) is None


@pytest.mark.parametrize("summarizer", ["model", "extractive"])
def test_every_running_summary_holds_the_facts_it_claims_to_cover(
    dev_model: Path, summarizer: str
) -> None:
    engine = make_engine(dev_model)
    conv = conversation(engine, HistoryPolicy(policy="summarize", max_summary_tokens=24))
    conv.summarizer = summarizer
    rng = random.Random(5)
    people = ["Ada", "Bruno", "Carmen", "Dmitri", "Esther", "Farid", "Greta", "Hugo"]
    for turn in range(36):
        if turn % 4 == 0:  # a fact every fourth turn, the rest filler
            person = people[turn // 4 % len(people)]
            text = f"My friend {person} turned {20 + turn} last week."
        else:
            text = user_text(rng)
        conv.turn(text, REPLY)
        if len(conv.summaries) >= 4:
            break
    while conv.pending_summary is not None:
        for out in engine.step():
            conv.on_output(out)
    assert len(conv.summaries) >= 3, "too few summaries were made"
    covered: tuple[str, ...] = ()
    for summary in conv.summaries:
        # Each one extends the one before and covers a prefix of the branch ...
        assert summary.covers[: len(covered)] == covered
        assert summary.covers == tuple(conv.order[: len(summary.covers)])
        covered = summary.covers
        # ... states every fact of the user messages it covers, and ends a whole sentence.
        assert covered_facts_missing(summary, conv.messages) == []
        assert end_at_sentence(summary.text) == summary.text
        assert summary.num_tokens <= BUDGET // 4
    assert any("turned" in s.text for s in conv.summaries)
    # Random weights write no summary worth keeping: every one is extracted, and says why.
    assert conv.history_stats.summaries_extracted == len(conv.summaries)
    if summarizer == "extractive":
        assert conv.summary_defects == [None] * len(conv.summaries)
        assert conv.history_stats.summary_tokens == 0
    else:
        assert all(d is not None for d in conv.summary_defects)
