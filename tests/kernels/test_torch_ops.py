"""The torch backend's step-cached ops equal the references exactly: across the layers of a
step (same metadata objects, different caches, window settings), across steps (new
metadata), and when a metadata tensor changes in place."""

from __future__ import annotations

import torch

from kvchat.kernels import get_attention_ops
from kvchat.kernels.cache_write import write_kv_cache_ref
from kvchat.kernels.decode_attention import paged_decode_attention_ref
from kvchat.kernels.torch_ops import StepCacheWrite, StepDecode

BLOCK = 16


def layer_caches(kv, gen: torch.Generator, lens: list[int], num_layers: int) -> list:
    """Several layers' pools sharing one block table (as the layers of a model do)."""
    first = kv.build_paged_kv(gen, lens, 2, 32, BLOCK, torch.float32)
    layers = [first]
    for _ in range(num_layers - 1):
        other = kv.build_paged_kv(gen, lens, 2, 32, BLOCK, torch.float32)
        other.block_tables, other.seq_lens = first.block_tables, first.seq_lens
        layers.append(other)
    return layers


def test_torch_backend_uses_the_step_cached_ops() -> None:
    ops = get_attention_ops("torch", torch.device("cpu"))
    assert isinstance(ops.decode, StepDecode) and isinstance(ops.write_kv_cache, StepCacheWrite)
    # One state per engine: two engines never share a plan.
    assert get_attention_ops("torch", torch.device("cpu")).decode is not ops.decode


def test_decode_equals_reference_over_layers_windows_and_steps(kv) -> None:
    gen = kv.generator("step-decode")
    decode = StepDecode(use_cpu_kernel=False)  # the plan caching, exactly
    lens = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]
    for step in range(3):  # new metadata tensors each step, as the model runner makes them
        layers = layer_caches(kv, gen, [n + step for n in lens], num_layers=3)
        tables = dict(block_tables=layers[0].block_tables, seq_lens=layers[0].seq_lens)
        for paged, window in zip(layers, [None, 20, None]):
            query = kv.random_query(gen, (len(lens), 4, 32), torch.float32)
            args = dict(scale=0.2, sliding_window=window, num_sink_tokens=2 if window else 0)
            out = decode(query, **paged.storage(), **tables, **args)
            ref = paged_decode_attention_ref(query, **paged.storage(), **tables, **args)
            assert torch.equal(out, ref)


def test_decode_sees_a_block_table_changed_in_place(kv) -> None:
    gen = kv.generator("step-decode-inplace")
    decode = StepDecode(use_cpu_kernel=False)  # the plan caching, exactly
    paged = kv.build_paged_kv(gen, [40, 40], 2, 32, BLOCK, torch.float32)
    query = kv.random_query(gen, (2, 4, 32), torch.float32)
    tables = dict(block_tables=paged.block_tables, seq_lens=paged.seq_lens)
    first = decode(query, **paged.storage(), **tables, scale=0.2)
    paged.block_tables[1] = paged.block_tables[0]  # sequence 1 now reads sequence 0's blocks
    paged.seq_lens[1] = 33
    second = decode(query, **paged.storage(), **tables, scale=0.2)
    ref = paged_decode_attention_ref(query, **paged.storage(), **tables, scale=0.2)
    assert torch.equal(second, ref) and not torch.equal(second[1], first[1])


def test_cache_write_equals_reference_with_and_without_padding(kv) -> None:
    gen = kv.generator("step-cache-write")
    write = StepCacheWrite()
    for slots in (torch.tensor([3, 17, 40, 5]), torch.tensor([3, -1, 40, -1])):
        for _ in range(2):  # two layers of one step
            key = torch.randn(4, 2, 32, generator=gen)
            value = torch.randn(4, 2, 32, generator=gen)
            ours = [torch.zeros(4, BLOCK, 2, 32) for _ in range(2)]
            want = [torch.zeros(4, BLOCK, 2, 32) for _ in range(2)]
            write(key, value, *ours, slots)
            write_kv_cache_ref(key, value, *want, slots)
            assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1])
