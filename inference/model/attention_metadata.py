"""What one forward step's attention needs besides q/k/v: where each token's KV goes and which
blocks each sequence reads. Built by the model runner, read by every decoder layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Sequences are ordered decodes first (one query token each), then prefills/extends.

    slot_mapping:    [num_tokens] int64, block_id * block_size + offset of each new token.
    num_decode:      number of leading decode sequences (= their number of tokens).
    decode_block_tables / decode_seq_lens:   [num_decode, max_blocks] int32 / [num_decode] int32
    prefill_block_tables / prefill_seq_lens: [num_prefill, max_blocks] int32 / [num_prefill]
    prefill_query_start_loc: [num_prefill + 1] int32, offsets into the prefill part of the
                     flattened tokens.
    seq_lens count the whole context including this step's new tokens.

    num_tokens:      tokens this metadata's attention covers (the leading ones of the step).
    window:          (size, sinks) overriding the layers' own window for this group: sequences
                     in sink + window mode.
    windowed:        the step's windowed sequences, as a group of their own whose tokens follow
                     this group's (they need other window arguments in the same kernels).
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    num_sink_tokens: int = 0
    num_tokens: int = 0
    window: tuple[int, int] | None = None
    windowed: AttentionMetadata | None = None

    @property
    def num_prefill(self) -> int:
        return self.prefill_seq_lens.shape[0]
