"""ModelRunner: turns a scheduled batch into tensors, runs the model, returns logits of the
sequences that sample this step."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from kernels import AttentionOps
from memory.kv_cache import KVCache

from .attention_metadata import AttentionMetadata
from .model import LlamaModel
from .scheduler import ScheduledBatch


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
        batch.seqs of the sequences those rows belong to)."""
        bs = self.block_size
        input_ids: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seq_index: list[int] = []
        offset = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
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

        dev = self.device
        nd = batch.num_decode
        tables = [seq.kv.block_ids for seq in batch.seqs]
        prefill_lens = batch.num_new_tokens[nd:]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev, non_blocking=True),
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
        )
        ids = torch.from_numpy(np.concatenate(input_ids)).to(dev, non_blocking=True)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev, non_blocking=True)
        hidden = self.model.forward(ids, pos_t, meta, self.kv_cache, self.ops)
        if not sample_rows:
            return torch.empty((0, self.model.config.vocab_size)), []
        rows = _int_tensor(sample_rows, dev, torch.long)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return logits, sample_seq_index
