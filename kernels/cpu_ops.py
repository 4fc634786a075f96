"""kvchat's CPU ops (C++), built for this machine:

- `gemv(x, weight, bias, prefetch=False)` (kernels/cpu_gemv.cpp): `F.linear` for 1 to
  `GEMV_MAX_ROWS` rows of x, reading the weight as stored (float32, bfloat16 or float16),
  with or without software prefetches ahead of the stream: a decode step's linears;
- `widen_gemm(x, weight, bias)` (same file): `F.linear` for many rows of x and a bfloat16 /
  float16 weight, in float32, widening the weight a cache-sized block at a time: a prefill
  chunk's linears where the CPU has no native half-precision GEMM;
- `decode_attention(...)` (kernels/cpu_decode_attention.cpp): paged decode attention read in
  place through the block table;
- `decode_attention_quantized(...)` (same file): the same over an int8 / fp8 / int4 cache
  and its scale caches, each row decoded as it is read;
- `prefill_attention(...)` (kernels/cpu_prefill_attention.cpp): paged prefill / extend
  attention (a chunk against its cached prefix, causal within), read in place the same way;
- `prefill_attention_quantized(...)` (same file): the same over an int8 / fp8 / int4 cache,
  each row decoded into the task's float32 tile as it is read (kernels/cpu_quant.h, shared
  with the decode kernel);
- `rms_norm(x, weight, eps)` (kernels/cpu_rms_norm.cpp): RMSNorm with torch's rounding, one op;
- `rotary_cache_write(...)`, `silu_mul(gate_up)` (kernels/cpu_layer_ops.cpp): RoPE on
  q and k with the KV cache write, and the MLP's activation, one op each.

They are compiled once per machine with `-march=native` by torch's extension builder and
cached under `$XDG_CACHE_HOME/kvchat/extensions` (or `KVCHAT_EXTENSIONS_DIR`), keyed by the
sources, their flags, torch's version and the CPU's flags, so a cache moved to another CPU is
rebuilt, never run with instructions it lacks. Processes that start together build once: the
builder holds an OS lock on `cpu_ops-<key>.flock` (released by the kernel when it exits, however
it exits) and the others wait on it, so a builder killed mid-build never leaves the rest waiting
on torch's own lock file, which is removed as stale when found under that lock. Where they
cannot be built (no C++ compiler), `load_cpu_ops()` says why and returns False; `Linear` then
chooses among the library paths only and the layers take the torch ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_gemv.cpp",
        "cpu_decode_attention.cpp",
        "cpu_prefill_attention.cpp",
        "cpu_rms_norm.cpp",
        "cpu_layer_ops.cpp",
    )
)
# included by the sources: in the build key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_vec.h", "cpu_quant.h"))
GEMV_MAX_ROWS = 16  # MAX_ROWS in the source
# -fopenmp: at::parallel_for is OpenMP in a header, serial without it; the runtime it links is
# the libgomp torch has already loaded (the same soname).
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")

# gemv(x, weight, bias, prefetch=False); widen_gemm(x, weight, bias)
GemvFn = Callable[..., torch.Tensor]
WidenFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def cpuinfo_field(field: str) -> str | None:
    """The first `field` line of /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """The CPU's feature flags, the part of the build key that -march=native reads."""
    import platform

    return cpuinfo_field("flags") or cpuinfo_field("Features") or platform.processor()


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers where the kernel gives them
    (a virtual machine's name is often only the brand, "AMD EPYC", which names no
    generation), or what the platform says."""
    import platform

    name = cpuinfo_field("model name") or platform.processor() or "unknown CPU"
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    return f"{name} (family {family} model {model})" if family and model else name


# The instruction-set features that decide which kernels a CPU runs well.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)


def cpu_isa() -> list[str]:
    flags = set(cpu_flags().split())
    return [f for f in ISA_FLAGS if f in flags]


def extensions_dir() -> Path:
    configured = os.environ.get("KVCHAT_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvchat" / "extensions"


def build_key() -> str:
    h = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)))
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(cpu_flags().encode())
    return h.hexdigest()[:16]


def load_gemv() -> GemvFn | None:
    """torch.ops.kvchat_cpu.gemv, built on first use; None where the machine cannot build it."""
    if not load_cpu_ops():
        return None
    op: GemvFn = torch.ops.kvchat_cpu.gemv
    return op


def load_widen_gemm() -> WidenFn | None:
    """torch.ops.kvchat_cpu.widen_gemm, built on first use; None where it cannot be built."""
    if not load_cpu_ops():
        return None
    op: WidenFn = torch.ops.kvchat_cpu.widen_gemm
    return op


@functools.cache
def load_cpu_ops() -> bool:
    """Build (first use) and load torch.ops.kvchat_cpu; False (with the reason logged) where the
    machine cannot build it."""
    try:
        from torch.utils import cpp_extension

        key = build_key()
        build_dir = extensions_dir() / f"cpu_ops-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's builder runs `ninja` from PATH: the one installed beside this interpreter
        # (the `ninja` package) when the environment is not activated.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        with builder_lock(build_dir):
            clear_stale_baton(build_dir)
            if not any(build_dir.glob("*.so")):
                log.info(
                    "building kvchat's CPU ops for this CPU in %s (once a machine, about a minute)",
                    build_dir,
                )
            cpp_extension.load(
                name=f"kvchat_cpu_ops_{key}",
                sources=[str(p) for p in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # any build failure leaves the library paths
        log.warning(
            "kvchat's CPU ops could not be built (%s: %s); decode linears use the "
            "library paths, attention the torch reference",
            type(e).__name__,
            str(e).splitlines()[0][:200],
        )
        return False
    return True


@contextlib.contextmanager
def builder_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build of `build_dir` against other processes: an flock on a file beside it,
    which the kernel releases when the holder exits, killed or not."""
    with open(build_dir.with_name(build_dir.name + ".flock"), "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(
                "another process is building kvchat's CPU ops in %s; waiting for it", build_dir
            )
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_stale_baton(build_dir: Path) -> bool:
    """Remove torch's build lock (`lock`, which its builder waits on for ever) when it is found
    under `builder_lock`: every builder holds that lock, so a baton seen then was left by a
    builder that died. True where one was removed."""
    baton = build_dir / "lock"
    if not baton.exists():
        return False
    log.warning("removing %s, left by a build of kvchat's CPU ops that did not finish", baton)
    baton.unlink(missing_ok=True)
    return True
