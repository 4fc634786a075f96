"""ModelRunner: turns a scheduled batch into tensors, runs the model, returns logits of the
sequences that sample this step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np
import torch

from kvchat.kernels import AttentionOps
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVWindow

from ..engine.scheduler import ScheduledBatch
from .attention_metadata import AttentionMetadata
from .model import LlamaModel


def _block_table_tensor(tables: Seq[list[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), longest] int32, -1 padded."""
    width = max((len(t) for t in tables), default=0)
    out = np.full((len(tables), max(width, 1)), -1, dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return torch.from_numpy(out).to(device, non_blocking=True)


def _int_tensor(values: Seq[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        ops: AttentionOps,
        block_size: int,
        num_sink_tokens: int = 0,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.ops = ops
        self.block_size = block_size
        self.num_sink_tokens = num_sink_tokens
        self.device = model.device

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns (logits [num_sampling, vocab] float32, indices into
        batch.seqs of the sequences those rows belong to).

        Sequences in sink + window mode run as a group of their own after the others (their
        attention takes other window arguments); within each group decodes come first."""
        bs = self.block_size
        # Sequences without a window first (possibly none), then one group per window.
        by_window: dict[KVWindow | None, list[int]] = {None: []}
        for i, seq in enumerate(batch.seqs):
            by_window.setdefault(seq.window if seq.in_window else None, []).append(i)
        input_ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_seq_index: list[int] = []
        offset = 0
        metas: list[AttentionMetadata] = []
        dev = self.device
        for window, group in by_window.items():
            # Decodes (one new token) first, in batch order.
            group = [i for i in group if batch.num_new_tokens[i] == 1] + [
                i for i in group if batch.num_new_tokens[i] != 1
            ]
            seq_lens: list[int] = []
            for i in group:
                seq, n = batch.seqs[i], batch.num_new_tokens[i]
                start = seq.num_computed_tokens
                pos = np.arange(start, start + n, dtype=np.int64)
                table = np.asarray(seq.kv.block_ids, dtype=np.int64)
                input_ids.append(np.asarray(seq.token_ids[start : start + n], dtype=np.int64))
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                seq_lens.append(start + n)
                offset += n
                if start + n == seq.num_tokens:
                    sample_rows.append(offset - 1)
                    sample_seq_index.append(i)
            nd = sum(1 for i in group if batch.num_new_tokens[i] == 1)
            tables = [batch.seqs[i].kv.block_ids for i in group]
            prefill_lens = [batch.num_new_tokens[i] for i in group[nd:]]
            metas.append(
                AttentionMetadata(
                    slot_mapping=torch.empty(0),
                    num_decode=nd,
                    decode_block_tables=_block_table_tensor(tables[:nd], dev),
                    decode_seq_lens=_int_tensor(seq_lens[:nd], dev, torch.int32),
                    prefill_block_tables=_block_table_tensor(tables[nd:], dev),
                    prefill_seq_lens=_int_tensor(seq_lens[nd:], dev, torch.int32),
                    prefill_query_start_loc=_int_tensor(
                        np.concatenate([[0], np.cumsum(prefill_lens, dtype=np.int64)]).tolist(),
                        dev,
                        torch.int32,
                    ),
                    num_sink_tokens=self.num_sink_tokens,
                    num_tokens=sum(batch.num_new_tokens[i] for i in group),
                    window=None if window is None else (window.size, window.num_sinks),
                )
            )
        meta = None
        for group_meta in reversed(metas):  # chained: each group's tokens follow the last's
            meta = dataclasses.replace(group_meta, windowed=meta)
        assert meta is not None
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(dev, non_blocking=True)
        meta = dataclasses.replace(meta, slot_mapping=slot_mapping)
        ids = torch.from_numpy(np.concatenate(input_ids)).to(dev, non_blocking=True)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev, non_blocking=True)
        hidden = self.model.forward(ids, pos_t, meta, self.kv_cache, self.ops)
        if not sample_rows:
            return torch.empty((0, self.model.config.vocab_size)), []
        rows = _int_tensor(sample_rows, dev, torch.long)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return logits, sample_seq_index
