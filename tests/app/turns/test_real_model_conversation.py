"""A conversation on SmolLM2-135M-Instruct, served from its pinned KV turn after turn, is what
transformers says from the stored history: each stored reply equals transformers' greedy reply
to the conversation up to it, rendered by transformers' own chat template from the GGUF."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

transformers = pytest.importorskip("transformers")

QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "What is a famous museum there?",
    "Name one painting you can see in it.",
)
MAX_TOKENS = 32
EOS_ID = 2  # <|im_end|>


def hf_model(gguf_path: Path) -> Any:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    return model


def test_a_pinned_conversation_is_what_transformers_says_from_its_stored_history(
    smollm2_dir: Path, smollm2_gguf: Path, tmp_path: Path
) -> None:
    from kvchat.app.main import create_app
    from kvchat_testing.app_service import service_settings

    settings = service_settings(smollm2_dir, tmp_path, None).model_copy(
        # float32 through F.linear and the torch attention, as transformers computes
        update={"dtype": "float32", "linear_path": "torch", "attention_backend": "torch"}
    )
    app = create_app(settings)
    with TestClient(app) as client:
        state = app.state.kvchat
        _, key = client.portal.call(state.store.create_key, "k")
        headers = {"Authorization": f"Bearer {key}"}
        conv = client.post("/v1/conversations", headers=headers, json={}).json()["id"]
        replies = []
        for question in QUESTIONS:
            r = client.post(
                f"/v1/conversations/{conv}/messages",
                headers=headers,
                json={"content": question, "temperature": 0, "max_tokens": MAX_TOKENS},
            )
            assert r.status_code == 200, r.text
            replies.append(r.json())
        stored = client.get(f"/v1/conversations/{conv}/messages", headers=headers).json()["data"]
    # Turns 2 and 3 prefilled only what was new: the rest came from the pinned KV.
    for before, after in itertools.pairwise(replies):
        previous = before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"]
        assert after["usage"]["cached_tokens"] >= previous - 1
    assert [m["role"] for m in stored] == ["user", "assistant"] * len(QUESTIONS)
    assert stored[1]["content"] == "The capital of France is Paris."

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )
    model = hf_model(smollm2_gguf)
    for turn in range(len(QUESTIONS)):
        history = [{"role": m["role"], "content": m["content"]} for m in stored[: 2 * turn + 1]]
        ids = tokenizer.apply_chat_template(
            history, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = torch.tensor([ids])
        assert prompt.shape[1] == replies[turn]["usage"]["prompt_tokens"]
        with torch.no_grad():
            out = model.generate(
                prompt,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=EOS_ID,
                pad_token_id=EOS_ID,
            )
        new = out[0, prompt.shape[1] :].tolist()
        expected = tokenizer.decode(new, skip_special_tokens=True)
        assert stored[2 * turn + 1]["content"] == expected, (turn, expected)
        assert replies[turn]["usage"]["completion_tokens"] == len(new)
