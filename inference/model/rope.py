"""Rotary position embedding with the scalings Llama-family checkpoints use."""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as `rope.rope_type` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    return inv_freq


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(dtype)
        sin = emb.sin().to(dtype)
        # sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * this.
        half = head_dim // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, signed sin), each [T, 1, D], as `apply_rotary` takes them;
        looked up once per forward, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (any heads: q and k may come together), positions: [T] -> rotated
        x, same shape."""
        return apply_rotary(x, *self.tables(positions))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], cos / signed_sin: [T, 1, D] (`RotaryEmbedding.tables`) -> x rotated,
    same shape: x * cos + rotate_half(x) * sin, in three ops instead of six."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
