"""A synthetic multi-turn chat workload shaped like vLLM's multi-turn benchmark: many
conversations of 12-18 turns sharing one system prompt, user and assistant turns of 50-150
tokens. Each conversation sends its next turn when the previous answer is complete, at once
(closed loop) or after a think time; conversations can start staggered, so many of them are
live (and idle between turns) at the same time."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams

# ChatML ids of the dev/bench tokenizer (cl100k + ChatML).
IM_START, IM_END, NEWLINE = 100264, 100265, 198
ROLE_IDS = {"system": 9125, "user": 882, "assistant": 78191}


@dataclass(frozen=True)
class WorkloadConfig:
    conversations: int = 6
    min_turns: int = 12
    max_turns: int = 18
    system_tokens: int = 300
    user_tokens: tuple[int, int] = (50, 150)
    assistant_tokens: tuple[int, int] = (50, 150)
    seed: int = 0
    think_time: tuple[float, float] = (0.0, 0.0)  # seconds between an answer and the next turn
    stagger: float = 0.0  # seconds between the starts of consecutive conversations


@dataclass
class Conversation:
    index: int
    turns: int
    user_messages: list[list[int]]
    answer_lengths: list[int]
    history: list[int] = field(default_factory=list)
    turn: int = 0
    think_times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    decode_tokens: int
    decode_seconds: float


def message(role: str, content: list[int]) -> list[int]:
    return [IM_START, ROLE_IDS[role], NEWLINE, *content, IM_END, NEWLINE]


def make_conversations(config: WorkloadConfig, vocab: int) -> tuple[list[int], list[Conversation]]:
    rng = random.Random(config.seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(1000, min(vocab, 100000)) for _ in range(n)]

    system = message("system", text(config.system_tokens))
    convs = []
    for i in range(config.conversations):
        turns = rng.randint(config.min_turns, config.max_turns)
        convs.append(
            Conversation(
                index=i,
                turns=turns,
                user_messages=[text(rng.randint(*config.user_tokens)) for _ in range(turns)],
                answer_lengths=[rng.randint(*config.assistant_tokens) for _ in range(turns)],
                history=list(system),
                think_times=[rng.uniform(*config.think_time) for _ in range(turns)],
            )
        )
    return system, convs


class MinimumPrefill:
    """The fewest prompt tokens any engine must compute: a token whose prefix was already
    computed (in any earlier prompt or generation) need not be, and each request computes at
    least one token."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self.total = 0

    def _insert(self, tokens: list[int]) -> int:
        node, created = self.root, 0
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                created += 1
            node = child
        return created

    def add_prompt(self, tokens: list[int]) -> None:
        self.total += max(1, self._insert(tokens))

    def add_computed(self, tokens: list[int]) -> None:
        self._insert(tokens)


def run_workload(
    engine: Engine, config: WorkloadConfig, use_sessions: bool, on_turn: object = None
) -> tuple[list[TurnRecord], int]:
    """Drive all conversations to the end; returns per-turn records and the minimum prefill."""
    _, convs = make_conversations(config, engine.model_config.vocab_size)
    minimum = MinimumPrefill()
    records: list[TurnRecord] = []
    live: dict[str, tuple[Conversation, list[int], float]] = {}

    def submit(conv: Conversation) -> None:
        user = message("user", conv.user_messages[conv.turn])
        prompt = conv.history + user + [IM_START, ROLE_IDS["assistant"], NEWLINE]
        rid = f"c{conv.index}-t{conv.turn}"
        params = SamplingParams(
            max_tokens=conv.answer_lengths[conv.turn], temperature=0.0, ignore_eos=True
        )
        engine.add_request(
            rid, prompt, params, session_id=f"conv-{conv.index}" if use_sessions else None
        )
        minimum.add_prompt(prompt)
        live[rid] = (conv, prompt, time.perf_counter())

    # (time the conversation sends its next turn, conversation), soonest first
    start = time.perf_counter()
    ready = [(start + i * config.stagger, conv) for i, conv in enumerate(convs)]
    first_token_at: dict[str, float] = {}
    while live or ready:
        now = time.perf_counter()
        due = [item for item in ready if item[0] <= now]
        for item in due:
            ready.remove(item)
            submit(item[1])
        if not live:
            time.sleep(max(0.0, min(t for t, _ in ready) - now))
            continue
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id not in first_token_at:
                first_token_at[out.request_id] = now
            if not out.finished:
                continue
            conv, prompt, sent = live.pop(out.request_id)
            generated = out.output_token_ids or []
            # Every token of the turn can have KV once it ends (a session computes the last
            # one after the reply), so none of it need be computed again.
            minimum.add_computed(prompt + generated)
            ttft = first_token_at.pop(out.request_id) - sent
            records.append(
                TurnRecord(
                    conversation=conv.index,
                    turn=conv.turn + 1,
                    prompt_tokens=len(prompt),
                    cached_tokens=out.num_cached_tokens,
                    ttft=ttft,
                    decode_tokens=len(generated) - 1,
                    decode_seconds=now - sent - ttft,
                )
            )
            if callable(on_turn):
                on_turn()
            conv.history = prompt + generated + [IM_END, NEWLINE]
            conv.turn += 1
            if conv.turn < conv.turns:
                ready.append((now + conv.think_times[conv.turn], conv))
    return records, minimum.total
