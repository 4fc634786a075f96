"""The CPU engine's allocator settings: with them, a decode step's large tensors (logits,
activations) reuse freed memory instead of faulting in fresh pages every step."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_hf_model

DECODE = """
import resource, sys
import inference.host_memory as host_memory
if sys.argv[2] == "default":
    host_memory._applied = False  # as if glibc had refused: the engine leaves malloc alone
from inference.engine import Engine
from inference.engine_config import EngineConfig
from inference.sampling_params import SamplingParams
engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32"))
for i in range(16):
    engine.add_request(str(i), list(range(1 + i, 33 + i)),
                       SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True))
for _ in range(5):
    engine.step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    engine.step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def faults_per_step(model: Path, mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", DECODE, str(model), mode], capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_decode_step_stops_faulting_in_fresh_pages(tmp_path: Path) -> None:
    # A vocabulary large enough that a batch's logits (16 x 50,000 float32) are megabytes.
    build_hf_model(tmp_path, "llama", vocab_size=50_000)
    default, kept = faults_per_step(tmp_path, "default"), faults_per_step(tmp_path, "kept")
    assert default > 500, default  # several MB first-touched every step
    assert kept < default / 10, (default, kept)
