"""Facts kept across trims, on the real model: each conversation states a name, a job, a city
and a friend's name in its first turns, chats on until a small budget has trimmed them away,
then asks for each. The history policies side by side, on one engine, in one run:

- whole history: no trimming (a budget that holds the whole conversation), the reference;
- drop: trimmed with watermarks, nothing kept of what was dropped;
- summarize (model): the running summary the model writes, kept when it passes the checks of
  history.summaries, else extracted;
- summarize (extractive): the running summary extracted from the dropped user messages.

    python bench/summaries.py [--model models/smollm2-135m-instruct] [--conversations 6]

Per policy: of the facts asked for, the share still in the prompt when asked (what the service
kept) and the share the greedy answer states (what the model made of it); the trims, summaries
and summaries extracted, and why generated ones were refused. Writes bench/results/summaries.md
and summaries.png."""

from __future__ import annotations

import argparse
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvchat.app.session_settings import SessionSettings
from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.engine.scheduler import SchedulerConfig
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.chat_template import load_chat_template
from kvchat.inference.text.context_builder import ContextBuilder
from kvchat.inference.text.conversation import Conversation
from kvchat.memory.config import CacheConfig, SessionBudget

NAMES = ["Ada", "Bruno", "Carmen", "Dmitri", "Esther", "Farid", "Greta", "Hiro", "Ines", "Jonas"]
JOBS = ["nurse", "carpenter", "pilot", "librarian", "chemist", "baker", "architect", "plumber"]
CITIES = ["Lyon", "Porto", "Krakow", "Osaka", "Denver", "Nairobi", "Tallinn", "Valencia"]
FRIENDS = ["Miriam", "Tobias", "Leila", "Oscar", "Priya", "Wendell", "Zofia", "Rafael"]
FILLER = [
    "Can you give me a tip for staying focused while working?",
    "What is a good way to start running regularly?",
    "How do I keep houseplants alive in winter?",
    "What should I cook for a quick dinner tonight?",
    "Any advice for sleeping better?",
    "How can I learn to play the guitar faster?",
    "What is an easy way to save money each month?",
    "How do I make my mornings less rushed?",
    "What games are fun to play with a group of friends?",
    "How do I write a polite email declining an invitation?",
    "What are some good habits for reading more books?",
    "How should I prepare for a long train journey?",
    "What is a simple stretching routine for the evening?",
    "How do I clean a cast iron pan?",
]
NUM_FILLER = 11  # 4 facts + 11 other turns: 15 turns before the questions
SYSTEM = "You are a helpful assistant."
# history.summary_defect's verdicts, by their first word
DEFECTS = {
    "empty": "was empty",
    "copies": "copied the transcript",
    "repeats": "repeated itself",
    "leaves": "left out a fact",
}
POLICIES = ("whole history", "drop", "summarize (model)", "summarize (extractive)")


@dataclass
class Persona:
    name: str
    job: str
    city: str
    friend: str

    def statements(self) -> list[str]:
        return [
            f"Hi! My name is {self.name}.",
            f"I work as a {self.job}.",
            f"I live in {self.city}.",
            f"My best friend is called {self.friend}.",
        ]

    def questions(self) -> list[tuple[str, str, str]]:
        """(kind, question, the fact its answer must state)"""
        return [
            ("name", "What is my name?", self.name),
            ("job", "What is my job?", self.job),
            ("city", "Which city do I live in?", self.city),
            ("friend", "What is my best friend called?", self.friend),
        ]


@dataclass
class Result:
    in_prompt: Counter[str] = field(default_factory=Counter)
    answered: Counter[str] = field(default_factory=Counter)
    asked: Counter[str] = field(default_factory=Counter)
    trims: int = 0
    summaries: int = 0
    extracted: int = 0
    defects: Counter[str] = field(default_factory=Counter)
    examples: list[tuple[str, str]] = field(default_factory=list)  # (question, answer)
    summary_texts: list[str] = field(default_factory=list)


def personas(n: int, seed: int) -> list[tuple[Persona, list[str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = Persona(rng.choice(NAMES), rng.choice(JOBS), rng.choice(CITIES), rng.choice(FRIENDS))
        out.append((p, rng.sample(FILLER, NUM_FILLER)))
    return out


def states(text: str, fact: str) -> bool:
    return re.search(rf"\b{re.escape(fact)}\b", text, re.IGNORECASE) is not None


def run_policy(
    engine: Engine,
    builder: ContextBuilder,
    policy: str,
    cases: list[tuple[Persona, list[str]]],
    args: argparse.Namespace,
    bar: tqdm,
) -> Result:
    result = Result()
    reply = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0)
    for i, (persona, filler) in enumerate(cases):
        session = f"{policy}-{i}"
        whole = policy == "whole history"
        budget = args.whole_budget if whole else args.budget
        engine.set_session_budget(session, SessionBudget(max_context_tokens=budget))
        conv = Conversation(
            engine,
            builder,
            session,
            system=SYSTEM,
            policy=SessionSettings(
                history_policy="none" if whole else policy.split()[0],
                max_summary_tokens=args.max_summary_tokens,
            ).policy(),
        )
        conv.summarizer = "extractive" if "extractive" in policy else "model"
        for text in [*persona.statements(), *filler]:
            conv.turn(text, reply)
            bar.update()
        for kind, question, fact in persona.questions():
            turn = conv.turn(question, reply)
            answer = turn.output.text or ""
            result.asked[kind] += 1
            result.in_prompt[kind] += states(builder.tokenizer.decode(turn.prompt_ids), fact)
            result.answered[kind] += states(answer, fact)
            if i == 0:
                result.examples.append((question, answer.strip().replace("\n", " ")))
            bar.update()
        while conv.pending_summary is not None:  # let the last one land before the next
            for out in engine.step():
                conv.on_output(out)
        stats = conv.history_stats
        result.trims += stats.trims
        result.summaries += stats.summaries
        result.extracted += stats.summaries_extracted
        result.defects.update(DEFECTS[d.split(" ")[0]] for d in conv.summary_defects if d)
        if i == 0:
            result.summary_texts = [s.text for s in conv.summaries]
        engine.close_session(session)  # applied by the next conversation's first step
    return result


def share(c: Counter[str], asked: Counter[str]) -> float:
    return sum(c.values()) / max(1, sum(asked.values()))


def report(results: dict[str, Result], args: argparse.Namespace) -> str:
    kinds = ("name", "job", "city", "friend")
    rows = []
    for policy, r in results.items():
        refused = ", ".join(f"{k} {n}" for k, n in r.defects.most_common()) or "-"
        rows.append(
            [
                policy,
                f"{share(r.in_prompt, r.asked):.0%}",
                f"{share(r.answered, r.asked):.0%}",
                *(f"{r.answered[k]}/{r.asked[k]}" for k in kinds),
                r.trims,
                r.summaries,
                r.extracted,
                refused,
            ]
        )
    header = machine_header(
        "Facts kept across trims: drop, summarize (model), summarize (extractive)",
        {
            "model": f"{args.model.name}, {args.dtype} weights",
            "conversations": f"{args.conversations} per policy, 15 turns (name, job, city and "
            "friend stated in turns 1-4, 11 other questions), then the 4 questions",
            "budget": f"max_context_tokens {args.budget} (whole history: {args.whole_budget}), "
            f"max_summary_tokens {args.max_summary_tokens}, replies of up to "
            f"{args.reply_tokens} greedy tokens",
        },
    )
    out = [
        header,
        "In the prompt: the fact appears in the prompt the question was asked with (the "
        "summary or the kept messages): what the service kept. Answered: the greedy answer "
        "states it (whole word, any case): what the model made of it.\n",
        markdown_table(
            [
                "policy",
                "in the prompt",
                "answered",
                "name",
                "job",
                "city",
                "friend",
                "trims",
                "summaries",
                "extracted",
                "generated summaries refused: they",
            ],
            rows,
        ),
    ]
    for policy, r in results.items():
        if not r.summary_texts and not r.examples:
            continue
        out.append(f"\n## {policy}: the first conversation\n")
        if r.summary_texts:
            out.append("Its last running summary:\n\n```\n" + r.summary_texts[-1] + "\n```\n")
        out.append(markdown_table(["question", "answer"], r.examples))
    return "\n".join(out)


def plot(results: dict[str, Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    kept = [100 * share(r.in_prompt, r.asked) for r in results.values()]
    answered = [100 * share(r.answered, r.asked) for r in results.values()]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], kept, width=0.4, label="in the prompt when asked")
    ax.bar([i + 0.2 for i in x], answered, width=0.4, label="stated by the answer")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("facts asked for (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Facts from the first turns, asked for after the budget trimmed them")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--budget", type=int, default=320)
    ap.add_argument("--whole-budget", type=int, default=4096)
    ap.add_argument("--max-summary-tokens", type=int, default=120)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "summaries.md")
    args = ap.parse_args()
    ensure_model(args.model, "smollm2-135m-instruct")
    engine = Engine(
        EngineConfig(
            model=str(args.model),
            dtype=args.dtype,
            device="cpu",
            cache=CacheConfig(block_size=16, kv_cache_bytes=512 * 2**20),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048),
        )
    )
    assert engine.tokenizer is not None
    builder = ContextBuilder(load_chat_template(args.model, engine.tokenizer), engine.tokenizer)
    cases = personas(args.conversations, args.seed)
    turns = len(POLICIES) * args.conversations * (4 + NUM_FILLER + 4)
    results = {}
    with tqdm(total=turns, desc="turns", unit="turn") as bar:
        for policy in POLICIES:
            results[policy] = run_policy(engine, builder, policy, cases, args, bar)
    text = report(results, args)
    args.out.write_text(text)
    plot(results, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
