"""LinearPlanCache: the linear plans this machine measured, kept on disk, so that a restart
loads its plan instead of probing again; and `plan_for`, the one way a model gets its plan.

The probe (linear_plan.measure_plan) takes a second or two on an idle machine and minutes on a
busy one (105 s for a 135M model in float32 beside other work), and its answer drifts with
how busy the machine was while it ran. What it depends on is fixed per machine and model
shape, so its result is kept under that key:

- the machine: the CPU's model, its ISA flags, torch's CPU kernel level, the CPU count and
  torch's thread count (cpu_description);
- the software: torch's version, the build key of kvchat's CPU kernels (their sources and
  flags; None where they cannot be built), the dtypes oneDNN runs natively;
- the model: the dtype and the [out, in] shapes of the layer weights the probe streams.

One JSON file per key, `<dtype>-<hash of the key>.json`, holding the key itself (checked on
load), the plan (LinearPlan.as_dict) and when and how long it was measured. A file is written
whole to a temporary file beside it and renamed over the old one, so a reader (another
replica starting at the same time) sees the old file or the new one, never a part. A file
that cannot be read or parsed is logged and measured over; one that cannot be written is
logged and the measured plan used all the same: the cache never stops a start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvchat.kernels.cpu_ops import build_key, load_cpu_ops

from .linear_plan import LinearPlan, cpu_description, fixed_plan, measure_plan, onednn_dtypes

log = logging.getLogger(__name__)

# Bumped when the probe or the file's layout changes: older files are then measured over.
FORMAT_VERSION = 1

MeasureFn = Callable[[Sequence[torch.Tensor], torch.dtype], LinearPlan]


def default_plan_dir() -> Path:
    """$XDG_CACHE_HOME/kvchat/linear_plans, else ~/.cache/kvchat/linear_plans: per machine
    and user, beside the CPU kernels' builds (kernels/cpu_ops.extensions_dir)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvchat" / "linear_plans"


def plan_key(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> dict[str, object]:
    """What a measured plan depends on (see the module docstring)."""
    return {
        "version": FORMAT_VERSION,
        **cpu_description(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "kernels": build_key() if load_cpu_ops() else None,
        "onednn_dtypes": sorted(str(d).removeprefix("torch.") for d in onednn_dtypes()),
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": [list(shape) for shape in shapes],
    }


@dataclass(frozen=True)
class LinearPlanCache:
    """Measured plans kept in `directory`. `refresh`: measure even when a plan is kept, and
    keep the new one (after a hardware change the key does not see, or to re-measure on an
    idle machine)."""

    directory: Path
    refresh: bool = False
    # A plan measured while other processes kept more than this many CPUs busy on average
    # serves its run and is not kept.
    busy_cpus: float = 0.3

    def path_for(self, key: dict[str, object]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{key['dtype']}-{digest}.json"

    def load(self, key: dict[str, object]) -> LinearPlan | None:
        """The plan kept under `key`; None when there is none or it cannot be used (logged)."""
        path = self.path_for(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["key"] != key:
                log.warning("linear plan cache: %s was kept for another key; measuring", path)
                return None
            plan = LinearPlan.from_dict(data["plan"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning(
                "linear plan cache: ignoring unreadable %s (%s: %s); measuring and rewriting it",
                path,
                type(e).__name__,
                e,
            )
            return None
        return replace(plan, cache_file=str(path), cached=True)

    def store(self, key: dict[str, object], plan: LinearPlan, seconds: float) -> Path | None:
        """Keep `plan` under `key` (atomically); None when it cannot be written (logged)."""
        path = self.path_for(key)
        record = {
            "key": key,
            "plan": plan.as_dict() | {"cached": False, "cache_file": None},
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "measure_seconds": round(seconds, 3),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
        temporary: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except OSError as e:
            log.warning("linear plan cache: cannot write %s (%s); the plan is not kept", path, e)
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            return None
        return path


def load_or_measure(
    layer_weights: Sequence[torch.Tensor],
    dtype: torch.dtype,
    cache: LinearPlanCache | None,
    measure: MeasureFn = measure_plan,
) -> LinearPlan:
    """The plan kept for these weights' shapes on this machine, or a measured one, kept when
    the machine was quiet while it was measured (other processes kept at most the cache's
    `busy_cpus` CPUs busy on average). `cache` None: measure, keep nothing."""
    key = plan_key([tuple(w.shape) for w in layer_weights], dtype) if cache else None
    if cache is not None and key is not None and not cache.refresh:
        plan = cache.load(key)
        if plan is not None:
            log.info("linear layers (cached in %s): %s", plan.cache_file, plan.summary())
            return plan
    start, others_before = time.perf_counter(), other_cpu_seconds()
    plan = measure(layer_weights, dtype)
    seconds = time.perf_counter() - start
    others_after = other_cpu_seconds()
    # CPUs other processes kept busy on average while the probe ran: timings taken beside
    # them are off (by 5-10x on two cores), so such a plan serves this run and is not kept.
    busy = (
        (others_after - others_before) / seconds
        if others_before is not None and others_after is not None and seconds > 0
        else 0.0
    )
    kept = None
    if busy > (cache.busy_cpus if cache is not None else LinearPlanCache.busy_cpus):
        # info, not a warning: a CLI's stderr stays its own (the plan still serves this run)
        log.info(
            "linear layers measured while other processes kept %.1f CPUs busy: the plan "
            "serves this run and is not kept (the next start measures again)",
            busy,
        )
    elif cache is not None and key is not None:
        kept = cache.store(key, plan, seconds)
    if kept is not None:
        plan = replace(plan, cache_file=str(kept))
    log.info(
        "linear layers (measured in %.1f s%s): %s",
        seconds,
        f", kept in {kept}" if kept else "",
        plan.summary(),
    )
    return plan


def other_cpu_seconds() -> float | None:
    """CPU seconds every other process on the machine has used since boot (the machine's
    busy time in /proc/stat less this process's own); None where /proc/stat is not there."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    own = sum(os.times()[:2])
    return busy / os.sysconf("SC_CLK_TCK") - own


_PLANS: dict[tuple[Any, ...], LinearPlan] = {}


def plan_for(
    layer_weights: Sequence[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    path: str = "auto",
    cache: LinearPlanCache | None = None,
) -> LinearPlan:
    """The plan for a model: fixed on CUDA or when `path` names one, else the kept or measured
    one, at most once per process per (dtype, shapes, cache)."""
    if device.type != "cpu" or path != "auto":
        return fixed_plan(dtype, device, path)
    key = (dtype, tuple(tuple(w.shape) for w in layer_weights), cache)
    if key not in _PLANS:
        _PLANS[key] = load_or_measure(layer_weights, dtype, cache)
    return _PLANS[key]
