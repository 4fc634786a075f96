"""What the predictive retention policy costs the engine, against a decode step, in one run.

    python bench/retention_cost.py          # writes bench/results/retention_cost.md

1. A decode step of the default model (SmolLM2-135M-Instruct, the engine in process, one
   sequence at ~1,000 tokens of context): the median of `--steps` steps.
2. The session store's own work per step with `--sessions` idle sessions (a third of them
   agents mid tool call, the rest people; as many offloaded to the host as pinned on the
   device), on a clock that advances by that decode step: each step runs what the engine runs
   between steps (`maintain()`: the watermarks and the round-robin prefetch scan), takes the
   two sessions it would move first under pressure, and ends one turn (a session released,
   ranked in). Timed for `predictive` and for `pinned` (least recently used), on the real
   SessionStore and block pools (the KV tensors are tiny: moving KV is not the policy's cost).

The goal: the policy's cost per step <= 1% of a decode step."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.inference.engine.config import EngineConfig
from kvchat.inference.engine.engine import Engine
from kvchat.inference.model.sampling_params import SamplingParams
from kvchat.memory.block_pool import BlockPool
from kvchat.memory.config import CacheConfig, RetentionConfig
from kvchat.memory.kv_cache import KVCache
from kvchat.memory.kv_cache_manager import KVCacheManager, KVState
from kvchat.memory.kv_spec import KVCacheSpec
from kvchat.memory.sessions import SessionState, SessionStore
from kvchat.memory.stats import CacheStats

PRESET = "smollm2-135m-instruct"
GOAL = 0.01
BS = 16


def decode_step_seconds(model_dir: Path, steps: int) -> float:
    """The median decode step of one sequence with ~1,000 tokens of context."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", linear_path="torch"))
    prompt = [(i * 7919) % 20_000 + 100 for i in range(1000)]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    engine.add_request("probe", prompt, params)
    times = []
    engine.step()  # the prefill
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:-1])


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


def policy_seconds(mode: str, num_sessions: int, step_s: float, steps: int) -> float:
    """The session store's work per simulated step (see the module docstring)."""
    clock = Clock()
    spec = KVCacheSpec(1, 1, 2, BS, torch.float32)
    device_blocks, host_blocks = num_sessions * 2 + 64, num_sessions * 2
    kv = KVCache(spec, device_blocks, torch.device("cpu"), host_blocks)
    manager = KVCacheManager(
        BlockPool(device_blocks),
        kv,
        BS,
        enable_prefix_caching=True,
        host_pool=BlockPool(host_blocks),
    )
    store = SessionStore(
        CacheConfig(block_size=BS, retention=RetentionConfig(mode=mode)),
        manager,
        CacheStats(),
        bytes_per_block=spec.bytes_per_block,
        clock=clock,
    )

    def turn(i: int) -> None:
        tokens = list(range(i * 100, i * 100 + 2 * BS))
        state = KVState()
        store.claim(f"s{i}", None, f"r{i}-{clock.now}", tokens, state)
        store.make_room(manager.num_new_blocks(state, len(tokens)))
        manager.allocate_slots(state, len(tokens))
        manager.commit(state, tokens, len(tokens))
        store.release(
            f"s{i}", f"r{i}-{clock.now}", tokens, state, "tool_calls" if i % 3 else "stop"
        )

    for i in range(num_sessions):
        turn(i)
        clock.now += 0.05
    for i in range(0, num_sessions, 2):
        store.evict(f"s{i}")  # half on the host
    spent = 0.0
    for step in range(steps):
        clock.now += step_s
        began = time.perf_counter()
        store.maintain()
        victims = store._victims(SessionState.RESIDENT)
        for _ in range(2):
            next(victims, None)
        spent += time.perf_counter() - began
        turn(step % num_sessions)  # a turn ends: the engine's own work, not timed
    return spent / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / PRESET)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=400, help="simulated steps per policy")
    ap.add_argument("--decode-steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS / "retention_cost.md")
    args = ap.parse_args()
    model = ensure_model(args.model, PRESET)
    step_s = decode_step_seconds(model, args.decode_steps)
    print(f"decode step: {step_s * 1e3:.2f} ms")
    rows = []
    for mode in ("predictive", "pinned"):
        cost = policy_seconds(mode, args.sessions, step_s, args.steps)
        share = cost / step_s
        print(f"{mode}: {cost * 1e3:.3f} ms a step, {share:.2%} of a decode step")
        rows.append([mode, f"{cost * 1e3:.3f}", f"{share:.2%}", "yes" if share <= GOAL else "no"])
    text = machine_header(
        "The retention policy's cost against a decode step",
        {
            "model": f"{model.name} (float32, the engine in process, linear path torch)",
            "idle sessions": args.sessions,
            "simulated steps": args.steps,
            "command": "python bench/retention_cost.py",
        },
    )
    text += "\n" + markdown_table(
        ["policy", "its work per step (ms)", "of a decode step", f"<= {GOAL:.0%}"], rows
    )
    text += (
        f"\nDecode step (one sequence, ~1,000 tokens of context, median of "
        f"{args.decode_steps}): {step_s * 1e3:.2f} ms.\n\n"
        "Per step: `maintain()` (watermarks, and the predictive policy's prefetch scan of 32 "
        "sessions a call, round robin), the first two sessions it would move under pressure "
        "(predictive: a ranking by value rebuilt once a second, sessions ranked in as their "
        "turns end), on a clock advancing by the decode step; a turn ends each step.\n"
    )
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
