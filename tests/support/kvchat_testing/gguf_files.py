"""Tiny GGUF files written with gguf.GGUFWriter from random Hugging Face tensors, as llama.cpp's
converter would write them (Q/K rows permuted for llama, 1-D tensors in F32)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import pre_tokenizers

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 1  # K-quant blocks span 256 columns
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "o Ġ"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
# K-quant blocks: (bytes per 256 values, offsets of the float16 scales in a block)
_K_QUANT_SCALES = {Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,)), Q.Q4_K: (144, (0, 2))}
_K_QUANT_SCALES |= {Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def byte_level_tokens() -> list[str]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return SPECIALS + alphabet + [m.replace(" ", "") for m in MERGES]


def hf_tensors(arch: str, seed: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names and shapes."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab_size, HIDDEN, generator=g),
        "model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
        "lm_head.weight": torch.randn(vocab_size, HIDDEN, generator=g),
    }
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        shapes = {
            "input_layernorm.weight": (HIDDEN,),
            "post_attention_layernorm.weight": (HIDDEN,),
            "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            "mlp.gate_proj.weight": (FFN, HIDDEN),
            "mlp.up_proj.weight": (FFN, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, FFN),
        }
        if arch == "qwen2":
            shapes |= {
                "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
                "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
                "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
            }
        for name, shape in shapes.items():
            tensors[p + name] = torch.randn(*shape, generator=g)
    return tensors


def gguf_name(hf_name: str) -> str:
    layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, _, kind = hf_name.rpartition(".")
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, n, module = stem.split(".", 3)
    return f"blk.{n}.{layer[module]}.{kind}"


def permute(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp converter's `permute`: each head's rotate-half rows interleaved."""
    return t.reshape(num_heads, 2, -1, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def encode_tensor(values: np.ndarray, qtype: Q, seed: int) -> np.ndarray:
    """`values` quantized to `qtype`; K-quants (which gguf cannot quantize) get random blocks
    with small finite scales instead, so they are compared to gguf's dequantize only."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in _K_QUANT_SCALES:
        size, scale_offsets = _K_QUANT_SCALES[qtype]
        rows, cols = values.shape
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        for offset in scale_offsets:
            scales = rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16)
            blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(values, qtype)


def write_tiny_gguf(
    path: Path, arch: str = "llama", qtype: Q = Q.F32, *, tied: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A one-layer model with a byte-level BPE vocabulary; returns the Hugging Face tensors."""
    tokens = byte_level_tokens()
    originals = hf_tensors(arch, seed, len(tokens))
    if tied:
        del originals["lm_head.weight"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    for i, (name, t) in enumerate(originals.items()):
        if arch == "llama" and ".q_proj." in name:
            t = permute(t, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            t = permute(t, KV_HEADS)
        values = t.numpy()
        if values.ndim == 1:
            writer.add_tensor(gguf_name(name), values.astype(np.float32))
        else:
            data = encode_tensor(values, qtype, seed + i)
            raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
            writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


SENTENCEPIECE_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "a", "▁h", "▁he", "ll"]
SENTENCEPIECE_PIECES += ["llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁t", "he", "▁the"]
SENTENCEPIECE_PIECES += ["at", "▁a", "▁at"]


def write_sentencepiece_gguf(path: Path) -> None:
    """A llama GGUF whose vocabulary is SentencePiece's (`tokenizer.ggml.model = llama`): <unk>,
    <s>, </s>, 256 byte tokens, then pieces scored best first, and no merges."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += SENTENCEPIECE_PIECES
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SENTENCEPIECE_PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SENTENCEPIECE_PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
