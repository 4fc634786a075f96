"""Builds the prompt set of bench/kv_quality.py, bench/data/kv_quality_prompts.json: chat prompts
of 300-2,000 tokens whose answer must quote a number or name from the prompt, scored exactly.

- documents: sections of the project's README, and a sentence of each with one of its numbers
  blanked out; the question asks for the number;
- code: modules of the project, and a module constant; the question asks for its value;
- conversations: a user states facts about themselves over several turns of chat; the last
  turn asks for one.

The set is frozen in the JSON file (the README and the code move on); run this only to make a
new set, and say so in the results:

    python bench/kv_quality_prompts.py [--out bench/data/kv_quality_prompts.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from kvchat.bench.common import REPO

OUT = Path(__file__).resolve().parent / "data" / "kv_quality_prompts.json"
MAX_CHARS = 6_000  # about 1,700 tokens of README or code
MIN_CHARS = 1_200

DOCUMENTS = [
    "The two commands",
    "The chat page and the operator view",
    "Frontends you already use",
    "Sampling",
    "Structured output",
    "Running a fleet",
    "On the CPU",
    "The attack campaign",
]
CODE = [
    "history/policy.py",
    "inference/model/sampling_params.py",
    "memory/kv_store.py",
    "app/turns/branches.py",
    "app/ops/limits.py",
    "inference/engine/host_memory.py",
    "kernels/quant.py",
]
PEOPLE = [
    ("Ada", "nurse", "Lyon", "Miriam", "1987", "Biscuit"),
    ("Bruno", "carpenter", "Porto", "Tobias", "1992", "Pepper"),
    ("Carmen", "pilot", "Krakow", "Leila", "1979", "Nimbus"),
    ("Dmitri", "librarian", "Osaka", "Oscar", "2001", "Juniper"),
    ("Esther", "chemist", "Denver", "Priya", "1984", "Marble"),
    ("Farid", "baker", "Nairobi", "Wendell", "1995", "Clementine"),
    ("Greta", "architect", "Tallinn", "Zofia", "1990", "Waffles"),
]
CHAT = [
    (
        "Can you suggest a weekend routine that helps me rest?",
        "Start Saturday slowly: a walk outside, a proper breakfast and no screens for the first "
        "hour. Keep one afternoon free of plans, and on Sunday evening prepare the week ahead "
        "so Monday does not start in a rush.",
    ),
    (
        "What is a good way to learn a few words of a new language every day?",
        "Pick ten words a day from things you actually say, write them on cards, and review the "
        "old cards before learning new ones. Saying them out loud in short sentences helps them "
        "stick far better than reading lists.",
    ),
    (
        "How do I keep my kitchen knives sharp?",
        "Hone them on a steel before each use, cut on wood or plastic boards rather than glass "
        "or stone, wash them by hand and dry them at once. Have them sharpened on a whetstone "
        "two or three times a year.",
    ),
    (
        "I want to read more books this year. Any tips?",
        "Carry a book everywhere, read a few pages at fixed moments such as breakfast or the "
        "commute, and give yourself permission to drop a book you do not enjoy. A short list of "
        "the next three books keeps you from stalling between them.",
    ),
    (
        "What should I pack for a three-day hiking trip?",
        "Layers rather than one heavy coat, a rain shell, two pairs of wool socks per day, a "
        "first-aid kit, a headlamp, water purification and food that needs little cooking. "
        "Keep the pack under a fifth of your body weight.",
    ),
]
QUESTIONS = [
    ("What is my name? Answer with the name only.", 0),
    ("Which city do I live in? Answer with the city only.", 2),
    ("What is my best friend called? Answer with the name only.", 3),
    ("In which year was I born? Answer with the year only.", 4),
    ("What is my dog's name? Answer with the name only.", 5),
    ("What is my job? Answer with one word.", 1),
    ("Which city do I live in? Answer with the city only.", 2),
]
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?![\w])")


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = re.search(rf"^#+ {re.escape(title)}\n", text, re.MULTILINE)
    assert start is not None, title
    end = re.search(r"^#+ ", text[start.end() :], re.MULTILINE)
    body = text[start.start() : start.end() + (end.start() if end else len(text))]
    return cut(body)


def cut(text: str) -> str:
    """At most MAX_CHARS, cut at a line break."""
    if len(text) <= MAX_CHARS:
        return text.strip()
    return text[: text.rindex("\n", 0, MAX_CHARS)].strip()


def document_prompt(title: str, rng: random.Random) -> dict[str, object]:
    doc = readme_section(title)
    counts: dict[str, int] = {}
    for n in NUMBER.findall(doc):
        counts[n] = counts.get(n, 0) + 1
    # Prose sentences (not table rows or code) holding a number the document states once.
    candidates = []
    for paragraph in re.split(r"\n\s*\n", doc):
        if paragraph.startswith(("|", "    ", "```", "#")) or "```" in paragraph:
            continue
        for sentence in re.split(r"(?<=[.;:])\s+", " ".join(paragraph.split())):
            once = [n for n in NUMBER.findall(sentence) if counts[n] == 1 and len(n) >= 2]
            if once and 40 <= len(sentence) <= 300:
                candidates.append((sentence, once[0]))
    assert candidates, f"no sentence of {title!r} states a number once"
    sentence, number = rng.choice(candidates)
    blanked = sentence.replace(number, "____", 1)
    question = (
        f"{doc}\n\nIn the text above, which number goes in the blank?\n\n"
        f'"{blanked}"\n\nAnswer with the number only.'
    )
    return asked(f"doc-{slug(title)}", "document", question, number)


def code_prompt(path: str, rng: random.Random) -> dict[str, object]:
    source = cut((REPO / path).read_text())
    constants = re.findall(r"^([A-Z][A-Z0-9_]+)\s*(?::\s*\w+\s*)?=\s*([\d_.]+)\b", source, re.M)
    unique = [(n, v) for n, v in constants if sum(m == n for m, _ in constants) == 1]
    assert unique, f"{path} defines no numeric constant in its first {MAX_CHARS} characters"
    name, value = rng.choice(unique)
    question = (
        f"Here is `{path}`:\n\n```python\n{source}\n```\n\n"
        f"In the code above, what is the value of `{name}`? Answer with the value only."
    )
    return asked(f"code-{slug(path)}", "code", question, value)


def asked(prompt_id: str, kind: str, question: str, answer: str) -> dict[str, object]:
    """A one-message prompt."""
    return {
        "id": prompt_id,
        "kind": kind,
        "messages": [{"role": "user", "content": question}],
        "answer": answer,
    }


def conversation_prompt(i: int, rng: random.Random) -> dict[str, object]:
    name, job, city, friend, born, dog = PEOPLE[i]
    facts = [name, job, city, friend, born, dog]
    stated = [
        (
            f"Hi! My name is {name} and I work as a {job}.",
            f"Nice to meet you, {name}! Being a {job} must keep you busy. How can I help?",
        ),
        (
            f"I moved to {city} last spring, and I was born in {born}.",
            f"{city} is a great place to settle in. What would you like to talk about?",
        ),
        (
            f"My best friend {friend} is visiting next week with my dog {dog}.",
            f"That sounds lovely. I hope you, {friend} and {dog} have a good time together.",
        ),
    ]
    chat = rng.sample(CHAT, len(CHAT))
    turns = [stated[0], *chat[:2], stated[1], *chat[2:4], stated[2], *chat[4:]]
    messages = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    question, which = QUESTIONS[i]
    messages.append({"role": "user", "content": question})
    return {
        "id": f"chat-{slug(name)}",
        "kind": "conversation",
        "messages": messages,
        "answer": facts[which],
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def build(seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    prompts = [document_prompt(title, rng) for title in DOCUMENTS]
    prompts += [code_prompt(path, rng) for path in CODE]
    prompts += [conversation_prompt(i, rng) for i in range(len(PEOPLE))]
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = build(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(prompts, indent=1, ensure_ascii=False) + "\n")
    for p in prompts:
        messages: list[dict[str, str]] = p["messages"]  # type: ignore[assignment]
        size = sum(len(m["content"]) for m in messages)
        print(f"{p['id']:<40} {p['kind']:<13} {size:>6} chars  answer {p['answer']!r}")


if __name__ == "__main__":
    main()
