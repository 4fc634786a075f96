"""GGUF import on tiny files written with gguf.GGUFWriter: weights dequantized as gguf does it,
llama.cpp's Q/K permutation undone, config and tokenizer files, and clear errors that leave
no directory behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from kvchat.inference.errors import GGUFImportError
from kvchat.inference.model.config import ModelConfig
from kvchat.inference.model.gguf_config import llama3_rope_scaling
from kvchat.inference.model.gguf_import import import_gguf, unpermute
from kvchat.inference.model.gguf_tokenizer import build_tokenizer
from kvchat.inference.model.weights import load_weights
from kvchat.inference.text.tokenizer_files import load_tokenizer
from kvchat_testing.gguf_files import (
    HEADS,
    KV_HEADS,
    SPECIALS,
    TEMPLATE,
    gguf_name,
    permute,
    write_sentencepiece_gguf,
    write_tiny_gguf,
)

# Q4_0..Q8_0 quantized by gguf from the random weights; K-quants are random blocks.
QUANTIZED = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    for heads, rows in ((1, 2), (1, 4), (4, 64), (3, 192)):
        t = torch.randn(rows, 5)
        assert torch.equal(unpermute(permute(t, heads), heads), t)
        # A head of size 2 is one rotary pair: nothing to interleave.
        assert torch.equal(permute(t, heads), t) == (rows // heads == 2)
        bias = torch.randn(rows)
        assert torch.equal(unpermute(permute(bias, heads), heads), bias)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_round_trip_gives_the_original_tensors(tmp_path: Path, arch: str) -> None:
    originals = write_tiny_gguf(tmp_path / "m.gguf", arch, Q.F32, seed=3)
    config = import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    written = load_file(tmp_path / "model" / "model.safetensors")
    assert written.keys() == originals.keys()
    for name, t in originals.items():
        assert torch.equal(written[name], t), name
    assert config.model_type == arch and config.qkv_bias == (arch == "qwen2")
    assert not config.tie_word_embeddings
    # What the engine loads is the same.
    loaded = load_weights(tmp_path / "model", config, torch.float32, torch.device("cpu"))
    assert torch.equal(
        loaded["model.layers.0.self_attn.k_proj.weight"],
        written["model.layers.0.self_attn.k_proj.weight"],
    )


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS, ids=lambda q: q.name)
def test_quantized_tensors_dequantize_as_gguf_does(tmp_path: Path, qtype: Q) -> None:
    originals = write_tiny_gguf(tmp_path / "m.gguf", "llama", qtype, seed=5)
    import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    written = load_file(tmp_path / "model" / "model.safetensors")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    sources = {t.name: t for t in reader.tensors}
    for name, original in originals.items():
        source = sources[gguf_name(name)]
        expected = torch.from_numpy(
            np.array(gguf.quants.dequantize(source.data, source.tensor_type))
        ).reshape(original.shape)
        if ".q_proj." in name:
            expected = unpermute(expected, HEADS)
        elif ".k_proj." in name:
            expected = unpermute(expected, KV_HEADS)
        assert torch.equal(written[name], expected), name
        if qtype not in K_QUANTS:
            # Unpermuted, the weights are the originals up to quantization error (4 bits of
            # a block's range at worst).
            tolerance = 0.02 if qtype in (Q.F16, Q.BF16) else 0.25
            assert (written[name] - original).abs().max() <= tolerance * original.abs().max()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_is_the_one_asked_for(tmp_path: Path, dtype: str) -> None:
    originals = write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.Q8_0)
    import_gguf(tmp_path / "m.gguf", tmp_path / "model", dtype=dtype)
    written = load_file(tmp_path / "model" / "model.safetensors")
    assert {t.dtype for t in written.values()} == {getattr(torch, dtype)}
    assert json.loads((tmp_path / "model" / "config.json").read_text())["torch_dtype"] == dtype
    assert written.keys() == originals.keys()


def test_config_tokenizer_and_template_files(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.Q8_0, tied=True)
    import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    model_dir = tmp_path / "model"
    config = ModelConfig.from_dir(model_dir)
    assert config.tie_word_embeddings
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, 64)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    assert (model_dir / "chat_template.jinja").read_text() == TEMPLATE
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    ids = tokenizer.encode("hello world")
    assert ids[0] == len(SPECIALS) + 256 + 2  # "hell": the merges "h e", "l l", "he ll"
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.encode("<|im_end|>", allow_special=True) == [2]


def test_a_sentencepiece_vocabulary_encodes_as_transformers_does(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_sentencepiece_gguf(tmp_path / "spm.gguf")
    reader = gguf.GGUFReader(tmp_path / "spm.gguf")
    ours = build_tokenizer({name: field.contents() for name, field in reader.fields.items()})
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    texts = ["hello world", "the hat", " hello  world", "xyz é", "hello\nworld", "a", ""]
    texts += ["<s>hello</s>", "wheat tea"]
    for text in texts:
        assert ours.encode(text).ids == theirs.encode(text), text  # with BOS
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
    # byte fallback for what no piece covers, merges by score for what they do
    assert ours.encode("hello é", add_special_tokens=False).ids == [273, 259, 198, 172]


def llama3_rope_factors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """llama.cpp converter's rope_freqs for Llama 3.1 (low 1, high 4, original 8192)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_is_recognised_from_rope_freqs(factor: float) -> None:
    freqs = llama3_rope_factors(500000.0, 128, factor).astype(np.float64)
    scaling = llama3_rope_scaling(freqs, 500000.0, 128)
    assert scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    freqs[10] *= 1.5
    with pytest.raises(GGUFImportError, match="not Llama 3's scaling"):
        llama3_rope_scaling(freqs, 500000.0, 128)


def test_an_unsupported_architecture_is_named_and_leaves_no_directory(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="architecture 'mamba' is not supported"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_an_unsupported_quantization_type_is_named(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.F32)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":  # IQ4_NL: 18 bytes per 32 values
            rows, cols = (int(n) for n in reversed(t.shape.tolist()))
            data = np.zeros((rows, cols // 32 * 18), dtype=np.uint8)
            writer.add_tensor(t.name, data, raw_dtype=Q.IQ4_NL)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"blk\.0\.ffn_up\.weight is of type IQ4_NL"):
        import_gguf(tmp_path / "iq.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("keep", [0, 3, 100, 0.5, -1])
def test_a_truncated_file_is_named_and_leaves_no_directory(tmp_path: Path, keep: float) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.Q4_0)
    data = (tmp_path / "m.gguf").read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    (tmp_path / "short.gguf").write_bytes(data[:cut])
    with pytest.raises(GGUFImportError, match=r"truncated|not a GGUF file|cannot read"):
        import_gguf(tmp_path / "short.gguf", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "short.gguf"]


def test_the_real_gguf_truncated_is_named_and_leaves_no_directory(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    with smollm2_gguf.open("rb") as f:
        (tmp_path / "short.gguf").write_bytes(f.read(40_000_000))
    with pytest.raises(GGUFImportError, match=r"short\.gguf is truncated or malformed"):
        import_gguf(tmp_path / "short.gguf", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.gguf"]


def test_an_existing_model_is_replaced_only_when_asked(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.F32)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("x")
    with pytest.raises(GGUFImportError, match="exists and is not empty"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "model")
    assert (tmp_path / "model" / "keep.txt").exists()
    import_gguf(tmp_path / "m.gguf", tmp_path / "model", replace=True)
    assert not (tmp_path / "model" / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "model"]
