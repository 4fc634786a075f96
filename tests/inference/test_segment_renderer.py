"""SegmentRenderer: exactly render_segments on every template the project supports (ChatML, its
tools default, Hugging Face's ChatML, a default system prompt, Llama 3 (both with the generic
tool format), Llama 3.1 and Qwen2.5 with tools), as a conversation grows turn by turn, is
trimmed at the front, branches and gets a summary; and a turn's rendering work does not grow
with the conversation."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from kvchat.inference.text.chat_template import CHATML_TEMPLATE, ChatMessage, ChatTemplate
from kvchat.inference.text.segment_renderer import SegmentRenderer
from kvchat.inference.text.tokenizer import Tokenizer
from kvchat_testing.chat_templates import (
    DEFAULT_SYSTEM_CHATML,
    HF_CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    LLAMA31_TEMPLATE,
    QWEN25_TEMPLATE,
    TOOLS,
    tool_call,
)

WORDS = "the cat sat on a mat and said <|im_end|> hello 😀 world of tokens".split()  # noqa: SIM905

TEMPLATES = [
    # (name, source, tokenizer fixture, tools, local)
    ("chatml", CHATML_TEMPLATE, "dev_tokenizer", None, True),
    ("chatml-tools", CHATML_TEMPLATE, "dev_tokenizer", TOOLS, True),
    ("hf-chatml", HF_CHATML_TEMPLATE, "dev_tokenizer", None, True),
    ("default-system", DEFAULT_SYSTEM_CHATML, "dev_tokenizer", None, False),
    ("default-system-generic-tools", DEFAULT_SYSTEM_CHATML, "dev_tokenizer", TOOLS, False),
    ("llama3", LLAMA3_TEMPLATE, "llama3_tokenizer", None, False),
    ("llama3-generic-tools", LLAMA3_TEMPLATE, "llama3_tokenizer", TOOLS, False),
    ("llama3.1-tools", LLAMA31_TEMPLATE, "llama3_tokenizer", TOOLS, False),
    ("llama3.1", LLAMA31_TEMPLATE, "llama3_tokenizer", None, False),
    ("qwen2.5-tools", QWEN25_TEMPLATE, "dev_tokenizer", TOOLS, False),
    ("qwen2.5", QWEN25_TEMPLATE, "dev_tokenizer", None, False),
]


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def turn(rng: random.Random, template: ChatTemplate, tools: Any, index: int) -> list[ChatMessage]:
    """A user message and a reply: generated ids, text, or (with tools) a call and its
    result before the reply."""
    user = ChatMessage("user", text(rng))
    kind = rng.random()
    if tools and kind < 0.3:
        call_id = f"call_{index}"
        return [
            user,
            ChatMessage(
                "assistant",
                None,
                tool_calls=(tool_call(call_id, "get_weather", '{"city": "Paris"}'),),
            ),
            ChatMessage("tool", text(rng), tool_call_id=call_id),
            ChatMessage("assistant", text(rng)),
        ]
    if kind < 0.7:
        ids = template.tokenize(text(rng))
        return [user, ChatMessage("assistant", None, token_ids=tuple(ids))]
    return [user, ChatMessage("assistant", text(rng))]


@pytest.mark.parametrize(
    ("name", "source", "tokenizer_name", "tools", "local"), TEMPLATES, ids=[t[0] for t in TEMPLATES]
)
def test_the_renderer_gives_exactly_render_segments_as_a_conversation_grows(
    name: str,
    source: str,
    tokenizer_name: str,
    tools: Any,
    local: bool,
    request: pytest.FixtureRequest,
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(tokenizer_name)
    template = ChatTemplate(source, tokenizer)
    renderer = SegmentRenderer(template)
    assert renderer.is_local is local
    rng = random.Random(name)
    system = [ChatMessage("system", "You are terse.")] if rng.random() < 0.7 else []
    history: list[ChatMessage] = []
    for index in range(14):
        history += turn(rng, template, tools, index)
        kept = history
        if index % 5 == 4:  # trimmed at the front, as the planner does
            kept = history[2 * (index // 5) :]
            while kept and kept[0].role != "user":
                kept = kept[1:]
        head = list(system)
        if index >= 9:
            head.append(ChatMessage("system", "Summary of the earlier conversation:\n" + text(rng)))
        for messages in (head + kept, head + kept[:-1]):  # the prompt; the reply's count
            if not messages:
                continue
            for prompt in (True, False):
                expected = template.render_segments(
                    messages, add_generation_prompt=prompt, tools=tools
                )
                got = renderer.render_segments(
                    messages, add_generation_prompt=prompt, tools=tools, state_key=("conv", prompt)
                )
                assert got == expected, (name, index, prompt)
                ids = renderer.render_ids(
                    messages, add_generation_prompt=prompt, tools=tools, state_key=("ids", prompt)
                )
                assert ids == [t for seg in expected for t in seg.token_ids]
            last = len(messages) - 1
            assert renderer.last_length(messages, tools=tools, state_key="last") == sum(
                len(seg.token_ids)
                for seg in template.render_segments(
                    messages, add_generation_prompt=False, tools=tools
                )
                if seg.message_index == last
            )


def test_a_branch_and_an_edit_reuse_nothing_stale(
    dev_tokenizer: Tokenizer, llama3_tokenizer: Tokenizer
) -> None:
    for source, tokenizer in (
        (LLAMA3_TEMPLATE, llama3_tokenizer),
        (CHATML_TEMPLATE, dev_tokenizer),
    ):
        template = ChatTemplate(source, tokenizer)
        renderer = SegmentRenderer(template)
        a = [
            ChatMessage("user", "one"),
            ChatMessage("assistant", "two"),
            ChatMessage("user", "three"),
        ]
        b = [
            ChatMessage("user", "one"),
            ChatMessage("assistant", "TWO, edited"),
            ChatMessage("user", "three"),
        ]
        for messages in (a, b, a[:1], a, [*b, ChatMessage("assistant", "four")]):
            assert renderer.render_segments(messages, state_key="c") == template.render_segments(
                messages
            )


def work(
    template: ChatTemplate, renderer: SegmentRenderer, messages: Sequence[ChatMessage], tools: Any
) -> tuple[int, int]:
    renders, chars = template.num_renders, template.num_tokenized_chars
    renderer.render_segments(messages, tools=tools, state_key="c")
    return template.num_renders - renders, template.num_tokenized_chars - chars


@pytest.mark.parametrize(
    ("name", "source", "tokenizer_name", "tools"),
    [
        ("chatml", CHATML_TEMPLATE, "dev_tokenizer", TOOLS),
        ("llama3.1", LLAMA31_TEMPLATE, "llama3_tokenizer", None),
        ("qwen2.5", QWEN25_TEMPLATE, "dev_tokenizer", TOOLS),
    ],
)
def test_a_turns_rendering_work_does_not_grow_with_the_conversation(
    name: str,
    source: str,
    tokenizer_name: str,
    tools: Any,
    request: pytest.FixtureRequest,
) -> None:
    """Renders and characters tokenized per turn at turn 5 and at turn 60 of the same
    conversation are the same (render_segments' would grow: a render per message)."""
    template = ChatTemplate(source, request.getfixturevalue(tokenizer_name))
    renderer = SegmentRenderer(template)
    messages = [ChatMessage("system", "You are terse.")]
    per_turn = []
    for index in range(60):
        messages += [
            ChatMessage("user", f"question {index:03d} about cats"),
            ChatMessage("assistant", f"answer {index:03d} is yes"),
        ]
        per_turn.append(work(template, renderer, messages, tools))
    early, late = per_turn[5], per_turn[59]
    assert late == early, (early, late)
    # And the old way, for scale: a render per message.
    before = template.num_renders
    template.render_segments(messages, tools=tools)
    assert template.num_renders - before > len(messages) > 10 * late[0]
