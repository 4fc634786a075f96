"""The Llama-family decoder (llama, qwen2, mistral) over a paged KV cache.

One forward runs a flattened batch: the new tokens of several sequences back to back,
decodes and prefill chunks mixed, each token placed by its position and slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat.kernels import AttentionOps
from kvchat.kernels.cpu_ops import load_cpu_ops
from kvchat.memory.kv_cache import KVCache

from ..engine.host_memory import HugePageArena
from .attention_metadata import AttentionMetadata
from .config import ModelConfig
from .linear import Linear
from .linear_plan import LinearPlan
from .linear_plan_cache import LinearPlanCache, plan_for
from .rope import RotaryEmbedding, apply_rotary

# One layer's (key_cache, value_cache, key_scales, value_scales), as KVCache.layer gives them.
LayerKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the model dtype (as Hugging Face does); on the
    CPU one C++ op (kernels/cpu_rms_norm.cpp) instead of four small ones on the per-token
    path."""
    if x.device.type == "cpu" and load_cpu_ops():
        return torch.ops.kvchat_cpu.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # the same products, without the casts and a second op
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> silu(gate) * up [T, I]; one C++ op on the CPU (one pass over the rows where
    torch's chunk, silu and multiply make two: 1.6-1.9x faster from 1 to 512 rows of 1,536 on
    AVX-512, torch's result to its rounding)."""
    if gate_up.device.type == "cpu" and load_cpu_ops():
        out: torch.Tensor = torch.ops.kvchat_cpu.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def place_in_huge_pages(
    weights: dict[str, torch.Tensor],
    linears: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]],
) -> None:
    """Move the linear weights and the embedding (the tied lm_head) into huge-page arenas
    (inference/engine/host_memory.py), in place of their tensors: what a decode step streams. The
    layers get an arena of their own, freed whole if their Linears re-lay them out (oneDNN's
    prepacked layout)."""

    def nbytes(t: torch.Tensor) -> int:
        return -(-t.numel() * t.element_size() // 4096) * 4096

    layers = HugePageArena(sum(nbytes(w) for layer in linears for w, _ in layer.values()))
    for i, layer in enumerate(linears):
        for name, (w, b) in layer.items():
            layer[name] = (layers.place(w), b)
        # the checkpoint's own o_proj and down_proj tensors: only the arena's copies remain
        weights.pop(f"model.layers.{i}.self_attn.o_proj.weight", None)
        weights.pop(f"model.layers.{i}.mlp.down_proj.weight", None)
    embed = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight")
    big = [embed] + ([head] if head is not None and head is not embed else [])
    arena = HugePageArena(sum(nbytes(t) for t in big))
    placed = {id(t): arena.place(t) for t in big}
    weights["model.embed_tokens.weight"] = placed[id(embed)]
    if head is not None:
        weights["lm_head.weight"] = placed[id(head)]


def fused_layer_weights(
    config: ModelConfig, index: int, w: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """A layer's linear weights ([out, in]) and biases as its projections read them, in the
    order a step does: one matmul for q|k|v and one for gate|up."""
    p = f"model.layers.{index}."
    names = ("q_proj", "k_proj", "v_proj")
    return {
        "qkv_proj": (
            torch.cat([w[p + f"self_attn.{n}.weight"] for n in names]),
            torch.cat([w[p + f"self_attn.{n}.bias"] for n in names]) if config.qkv_bias else None,
        ),
        "o_proj": (w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias")),
        "gate_up_proj": (
            torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            torch.cat([w[p + "mlp.gate_proj.bias"], w[p + "mlp.up_proj.bias"]])
            if config.mlp_bias
            else None,
        ),
        "down_proj": (w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias")),
    }


class DecoderLayer:
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        w: dict[str, torch.Tensor],
        linears: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
        plan: LinearPlan,
    ) -> None:
        p = f"model.layers.{index}."
        self.config = config
        self.index = index
        self.sliding_window = config.sliding_windows[index]
        self.scale = config.head_dim**-0.5
        self.input_norm = w[p + "input_layernorm.weight"]
        self.post_attention_norm = w[p + "post_attention_layernorm.weight"]
        self.qkv_proj = Linear(*linears["qkv_proj"], plan)
        self.o_proj = Linear(*linears["o_proj"], plan)
        self.gate_up_proj = Linear(*linears["gate_up_proj"], plan)
        self.down_proj = Linear(*linears["down_proj"], plan)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim] rotary tables at the tokens' positions
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_views: LayerKV,
        ops: AttentionOps,
        key_rotation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder layer over the step's tokens. `key_rotation`: the cache stores keys
        turned by it (kernels.quant.key_rotation); queries are turned alike, so q·k holds."""
        c = self.config
        num_tokens = x.shape[0]
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = self.qkv_proj(h)  # [T, q_size + 2 * kv_size]
        key_cache, value_cache, key_scales, value_scales = kv_views
        q = (
            ops.rotary_cache_write(
                qkv,
                cos,
                sin,
                key_cache,
                value_cache,
                meta.slot_mapping,
                c.num_heads,
                c.num_kv_heads,
                key_scales,
            )
            if ops.rotary_cache_write is not None and key_rotation is None
            else None
        )
        if q is None:
            # q and k heads side by side: one rotation for both. [T, Hq + Hkv, D]
            qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, -1, c.head_dim)
            qk = apply_rotary(qk, cos, sin)
            if key_rotation is not None:  # in float32: a half type would round what it turns
                qk = (qk.float() @ key_rotation).to(qk.dtype)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
            ops.write_kv_cache(
                k, v, key_cache, value_cache, meta.slot_mapping, key_scales, value_scales
            )
        attn = torch.empty_like(q)  # [T, Hq, D]
        scales = dict(key_scale_cache=key_scales, value_scale_cache=value_scales)
        group: AttentionMetadata | None = meta
        start = 0
        while group is not None:  # the step's groups, one after another in the tokens
            end = start + group.num_tokens
            if group.window is None:
                window = dict(
                    sliding_window=self.sliding_window, num_sink_tokens=group.num_sink_tokens
                )
            else:
                window = dict(sliding_window=group.window[0], num_sink_tokens=group.window[1])
            mid = start + group.num_decode
            if group.num_decode:
                ops.decode(
                    q[start:mid],
                    key_cache,
                    value_cache,
                    group.decode_block_tables,
                    group.decode_seq_lens,
                    self.scale,
                    out=attn[start:mid],
                    **window,
                    **scales,
                )
            if mid < end:
                ops.prefill(
                    q[mid:end],
                    key_cache,
                    value_cache,
                    group.prefill_block_tables,
                    group.prefill_seq_lens,
                    group.prefill_query_start_loc,
                    self.scale,
                    out=attn[mid:end],
                    **window,
                    **scales,
                )
            start, group = end, group.windowed
        x = x + self.o_proj(attn.view(num_tokens, c.q_size))

        h = rms_norm(x, self.post_attention_norm, c.rms_norm_eps)
        return x + self.down_proj(silu_mul(self.gate_up_proj(h)))


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        linear_path: str = "auto",
        linear_plan_cache: LinearPlanCache | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        linears = [fused_layer_weights(config, i, weights) for i in range(config.num_layers)]
        # q, k, v, gate and up as loaded are now only in their fused copies: drop them, so the
        # model is held once.
        for i in range(config.num_layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                weights.pop(f"model.layers.{i}.self_attn.{name}.weight", None)
            for name in ("gate_proj", "up_proj"):
                weights.pop(f"model.layers.{i}.mlp.{name}.weight", None)
        if device.type == "cpu":
            place_in_huge_pages(weights, linears)
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.linear_plan = plan_for(
            [w for layer in linears for w, _ in layer.values()],
            dtype,
            device,
            linear_path,
            linear_plan_cache,
        )
        # A tied lm_head reads the embedding's tensor as stored: one copy of the largest weight.
        self.lm_head = Linear(weights["lm_head.weight"], None, self.linear_plan, is_head=True)
        self.final_norm = weights["model.norm.weight"]
        self.layers = [
            DecoderLayer(config, i, weights, linears[i], self.linear_plan)
            for i in range(config.num_layers)
        ]
        self.rope = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, device)
        self._views_of: KVCache | None = None
        self._views: list[LayerKV] = []

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: KVCache,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """-> hidden states [T, hidden] after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope.tables(positions)
        turn = kv_cache.key_rotation
        for layer, kv_views in zip(self.layers, self._layer_views(kv_cache)):
            x = layer.forward(x, cos, sin, meta, kv_views, ops, turn)
        return rms_norm(x, self.final_norm, self.config.rms_norm_eps)

    def _layer_views(self, kv_cache: KVCache) -> list[LayerKV]:
        """Each layer's (key, value, key scales, value scales) views of the pool, made once
        per pool rather than once per layer and step."""
        if self._views_of is not kv_cache:
            self._views = [kv_cache.layer(i) for i in range(self.config.num_layers)]
            self._views_of = kv_cache
        return self._views

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()
