"""Long conversations under a context budget far smaller than the conversation: the history
policies side by side (drop with watermarks, drop_oldest, summarize), each turn planned by
history and run through inference.text.conversation on one engine.

Used by bench/multiturn.py (`--scenario long`); per turn it records TTFT and the prompt tokens
the engine computed, and per policy the trim events, tokens dropped and summaries made."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvchat.app.session_settings import SessionSettings
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.chat_template import load_chat_template
from kvchat.inference.text.context_builder import ContextBuilder
from kvchat.inference.text.conversation import Conversation
from kvchat.memory.config import CacheConfig, SessionBudget
from kvchat.memory.stats import HistoryStats

POLICIES = ("drop", "drop_oldest", "summarize")
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "be",
    "this",
    "are",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "more",
    "if",
    "out",
    "so",
    "said",
    "river",
    "lantern",
    "copper",
    "orbit",
    "maple",
    "quartz",
    "harbor",
    "summit",
    "willow",
    "kettle",
    "velvet",
    "tundra",
]


@dataclass(frozen=True)
class LongConfig:
    conversations: int = 3
    turns: int = 40
    max_context_tokens: int = 1024
    user_tokens: tuple[int, int] = (40, 120)  # words, roughly tokens
    reply_tokens: int = 32
    max_summary_tokens: int = 96
    system: str = "You are a helpful assistant. Answer briefly and keep track of the facts."
    seed: int = 0


@dataclass
class PolicyRun:
    policy: str
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn -> seconds
    prefill: dict[int, list[int]] = field(default_factory=dict)  # turn -> computed tokens
    trims: int = 0
    dropped_tokens: int = 0
    summaries: int = 0
    summary_tokens: int = 0
    wall: float = 0.0

    @property
    def total_prefill(self) -> int:
        return sum(sum(v) for v in self.prefill.values())


def user_texts(config: LongConfig, index: int) -> list[str]:
    rng = random.Random(config.seed * 1000 + index)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(*config.user_tokens)))
        for _ in range(config.turns)
    ]


def run_policy(model_dir: Path, dtype: str, config: LongConfig, policy: str) -> PolicyRun:
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            device="cpu",
            cache=CacheConfig(block_size=16, kv_cache_bytes=512 * 2**20),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048),
        )
    )
    assert engine.tokenizer is not None
    builder = ContextBuilder(load_chat_template(model_dir, engine.tokenizer), engine.tokenizer)
    hist = SessionSettings(
        history_policy=policy, max_summary_tokens=config.max_summary_tokens
    ).policy()
    convs = []
    for i in range(config.conversations):
        session = f"long-{i}"
        engine.set_session_budget(
            session, SessionBudget(max_context_tokens=config.max_context_tokens)
        )
        conv = Conversation(engine, builder, session, system=config.system, policy=hist)
        # Random weights write text only when sampled; seeded, so every policy sees the same.
        conv.summary_params = SamplingParams(
            max_tokens=config.max_summary_tokens, temperature=1.0, seed=i
        )
        convs.append(conv)
    texts = [user_texts(config, i) for i in range(config.conversations)]
    run = PolicyRun(policy)
    turn_of = [0] * config.conversations
    live: dict[str, tuple[int, float, int, object]] = {}  # request -> (conv, sent, prompt, plan)
    first: dict[str, float] = {}

    def submit(i: int) -> None:
        params = SamplingParams(
            max_tokens=config.reply_tokens,
            temperature=1.0,
            seed=turn_of[i] * 100 + i,
            ignore_eos=True,
        )
        request_id, plan, prompt = convs[i].submit(texts[i][turn_of[i]], params)
        live[request_id] = (i, time.perf_counter(), len(prompt), plan)

    start = time.perf_counter()
    with tqdm(total=config.conversations * config.turns, desc=policy, unit="turn") as bar:
        for i in range(config.conversations):
            submit(i)
        while live or any(c.pending_summary for c in convs):
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id not in live:
                    for conv in convs:
                        if conv.on_output(out):
                            break
                    continue
                first.setdefault(out.request_id, now)
                if not out.finished:
                    continue
                i, sent, prompt_len, plan = live.pop(out.request_id)
                turn = turn_of[i] + 1
                run.ttft.setdefault(turn, []).append(first.pop(out.request_id) - sent)
                run.prefill.setdefault(turn, []).append(prompt_len - out.num_cached_tokens)
                convs[i].finish_turn(out)
                if policy == "summarize":
                    convs[i].maybe_summarize(plan)  # type: ignore[arg-type]
                bar.update(1)
                turn_of[i] += 1
                if turn_of[i] < config.turns:
                    submit(i)
    run.wall = time.perf_counter() - start
    history = HistoryStats()
    for conv in convs:
        history.add(conv.history_stats)
    run.trims, run.dropped_tokens = history.trims, history.dropped_tokens
    run.summaries, run.summary_tokens = history.summaries, history.summary_tokens
    return run


def report(runs: dict[str, PolicyRun], config: LongConfig, out_png: Path) -> tuple[str, str]:
    """(markdown tables, goal line)"""
    from kvchat.bench.common import markdown_table

    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    summary_rows = []
    for policy, run in runs.items():
        ttfts = [t for v in run.ttft.values() for t in v]
        summary_rows.append(
            [
                policy,
                f"{run.total_prefill:,}",
                run.trims,
                f"{run.dropped_tokens:,}",
                run.summaries,
                run.summary_tokens,
                f"{med(ttfts) * 1e3:.0f}",
                f"{sorted(ttfts)[int(0.99 * (len(ttfts) - 1))] * 1e3:.0f}",
                f"{run.wall:.0f}",
            ]
        )
    turn_rows = []
    for turn in range(1, config.turns + 1):
        row: list[object] = [turn]
        for run in runs.values():
            row.append(f"{med(run.ttft[turn]) * 1e3:.0f} / {med(run.prefill[turn]):.0f}")
        turn_rows.append(row)
    ratio = runs["drop_oldest"].total_prefill / runs["drop"].total_prefill
    goal = (
        f"Prompt tokens computed, drop_oldest / drop (watermarks) = {ratio:.1f}x; "
        f"summarize computed {runs['summarize'].total_prefill / runs['drop'].total_prefill:.2f}x "
        "of drop (its summary changes the prefix once more per trim event)."
    )
    text = "### Summary\n\n" + markdown_table(
        [
            "policy",
            "prompt tokens computed",
            "trim events",
            "tokens dropped",
            "summaries",
            "summary tokens",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "wall s",
        ],
        summary_rows,
    )
    text += "\n### By turn: median TTFT ms / prompt tokens computed\n\n" + markdown_table(
        ["turn", *runs], turn_rows
    )
    plot(runs, config, out_png)
    return text, goal


def plot(runs: dict[str, PolicyRun], config: LongConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True)
    for policy, run in runs.items():
        turns = sorted(run.prefill)
        top.plot(turns, [statistics.median(run.prefill[t]) for t in turns], label=policy)
        bottom.plot(turns, [statistics.median(run.ttft[t]) * 1e3 for t in turns], label=policy)
    top.set_ylabel("prompt tokens computed")
    top.set_title(
        f"Long conversations, context budget {config.max_context_tokens} tokens", fontsize=9
    )
    bottom.set_ylabel("median TTFT (ms)")
    bottom.set_xlabel("turn number")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
