"""SmolLM2-135M-Instruct imported from its Q4_1 GGUF, against transformers loading the same
GGUF itself: greedy tokens from kvchat's engine, rendered chat prompts and the tokenizer,
id for id. The model is fetched and imported once per machine (kvchat_testing.real_model)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.inference.text.chat_template import ChatMessage, ChatTemplate, load_chat_template
from kvchat.inference.text.tokenizer import Tokenizer
from kvchat.inference.text.tokenizer_files import load_tokenizer
from kvchat.memory.config import CacheConfig
from kvchat_testing.chat_templates import QWEN25_TEMPLATE, TOOLS, tool_call

transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = 24
EOS_ID = 2  # <|im_end|>

PROMPTS: list[list[ChatMessage]] = [
    [ChatMessage("user", "What is the capital of France? Answer in one sentence.")],
    [ChatMessage("user", "Write a haiku about the sea.")],
    [ChatMessage("user", "List three primary colors.")],
    [ChatMessage("user", "What is 12 + 7?")],
    [ChatMessage("user", "Translate 'good morning' into Spanish.")],
    [ChatMessage("user", "Write a Python function that returns the square of a number.")],
    [ChatMessage("user", "Who wrote Romeo and Juliet?")],
    [ChatMessage("system", "You are a pirate."), ChatMessage("user", "Say hello to my friend.")],
    [
        ChatMessage("user", "My name is Ada."),
        ChatMessage("assistant", "Nice to meet you, Ada!"),
        ChatMessage("user", "What is my name?"),
    ],
]

SYSTEM_CONVERSATION = [
    ChatMessage("system", "You answer in French."),
    ChatMessage("user", "How are you today?"),
]
MULTI_TURN_CONVERSATION = [
    ChatMessage("user", "Hi!"),
    ChatMessage("assistant", "Hello! How can I help?"),
    ChatMessage("user", "Tell me a joke about  spaces\tand tabs."),
    ChatMessage("assistant", "Why did the tab leave? It needed more space."),
    ChatMessage("user", "Another one, with numbers: 3.14159 and 2024-06-01?"),
]
TOOL_CONVERSATION = [
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage(
        "assistant",
        None,
        tool_calls=(tool_call("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),),
    ),
    ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1"),
    ChatMessage("assistant", "21 °C."),
    ChatMessage("user", "And Tokyo?"),
]

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "1234567890 and 3.14159 and -42",
    "2024-06-01T12:30:00Z",
    "def square(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "naïve café résumé façade",
    "Grüße aus München, Straße",
    "日本語のテキスト、東京",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "emoji 🙂🚀 and 👨‍👩‍👧",
    "I'm sure they'll say it's fine, won't they?",
    "URL: https://example.com/path?q=1&x=y#frag",
    '{"key": [1, 2, {"nested": null}]}',
    "a <b>tag</b> & an &amp; entity",
    "CamelCaseIdentifiers and snake_case_names",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    loaded = load_tokenizer(smollm2_dir)
    assert loaded is not None
    return loaded


def hf_gguf_model(gguf_path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' model on the GGUF and the tensors its GGUF loader made, float32.

    `from_pretrained(gguf_file=...)` does the same but insists on `accelerate` being
    installed; its loader (`load_gguf_checkpoint`: dequantize, unpermute, rename) is
    called here directly instead."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(tensors["tensors"], strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    return model, tensors["tensors"]


def hf_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as transformers' templates take them: tool-call arguments as objects."""
    converted = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                dict(
                    call,
                    function=dict(
                        call["function"], arguments=json.loads(call["function"]["arguments"])
                    ),
                )
                for call in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        converted.append(message)
    return converted


def test_greedy_tokens_equal_transformers_on_the_gguf(
    smollm2_dir: Path, smollm2_gguf: Path, tokenizer: Tokenizer
) -> None:
    template = load_chat_template(smollm2_dir, tokenizer)
    prompts = [template.render_ids(messages) for messages in PROMPTS]
    engine = Engine(
        EngineConfig(
            model=str(smollm2_dir),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            # F.linear, as transformers runs it: no start-up timing of the alternatives
            linear_path="torch",
            cache=CacheConfig(block_size=16, num_blocks_override=128),
        )
    )
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    ours: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.output_token_ids is not None
                ours[int(out.request_id)] = list(out.output_token_ids)
                texts[int(out.request_id)] = out.text

    model, hf_tensors = hf_gguf_model(smollm2_gguf)
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == sorted(hf_tensors)
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            assert torch.equal(f.get_tensor(name), hf_tensors[name]), name
    # transformers' greedy choice after the prompt and each of our tokens (one forward per
    # prompt): equal at every position is the same as equal greedy sequences.
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            logits = model(torch.tensor([ids + ours[i]])).logits[0]
        expected = logits[len(ids) - 1 : -1].argmax(dim=-1).tolist()
        assert ours[i] == expected, (PROMPTS[i], texts[i])
        assert len(ours[i]) == MAX_NEW_TOKENS or ours[i][-1] == EOS_ID
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompts[0]]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
        )
    assert generated[0, len(prompts[0]) :].tolist() == ours[0]
    assert texts[0] == "The capital of France is Paris."
    assert sum(len(tokens) for tokens in ours.values()) > 4 * len(PROMPTS)


@pytest.mark.parametrize(
    "messages",
    [SYSTEM_CONVERSATION, MULTI_TURN_CONVERSATION, MULTI_TURN_CONVERSATION[:1]],
    ids=["system", "multi-turn", "default-system"],
)
def test_rendered_prompts_equal_transformers(
    smollm2_dir: Path, tokenizer: Tokenizer, hf_tokenizer: Any, messages: list[ChatMessage]
) -> None:
    template = load_chat_template(smollm2_dir, tokenizer)
    expected = hf_tokenizer.apply_chat_template(
        hf_messages(messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert template.render_ids(messages) == expected
    assert template.render_ids(messages, add_generation_prompt=False) == (
        hf_tokenizer.apply_chat_template(
            hf_messages(messages), add_generation_prompt=False, tokenize=True, return_dict=False
        )
    )


def test_a_tool_conversation_renders_as_transformers_does(
    tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    # SmolLM2's own template knows no tools: Qwen2.5's (verbatim) stands in, over SmolLM2's
    # vocabulary, where its <tool_call> tags are plain text.
    template = ChatTemplate(QWEN25_TEMPLATE, tokenizer)
    assert not template.is_generic
    expected = hf_tokenizer.apply_chat_template(
        hf_messages(TOOL_CONVERSATION),
        tools=TOOLS,
        chat_template=QWEN25_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert template.render_ids(TOOL_CONVERSATION, tools=TOOLS) == expected


def test_tokenizer_encodes_like_transformers_gguf_tokenizer(
    tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    for text in TEXTS:
        ours = tokenizer.encode(text)
        assert ours == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ours) == text
    # Control tokens are single ids when special tokens are allowed, text otherwise.
    assert tokenizer.encode("<|im_start|>user", allow_special=True)[0] == 1
    assert 1 not in tokenizer.encode("<|im_start|>user")
