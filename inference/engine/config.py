"""EngineConfig: everything the engine is built from (built once, from CLI flags or the
service settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvchat.kernels import ATTENTION_BACKENDS
from kvchat.memory.config import CacheConfig

from ..errors import InvalidRequestError
from ..model.linear_plan import LINEAR_PATHS
from .scheduler import SchedulerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available
    attention_backend: str = "auto"
    # The linear layers' paths on the CPU: auto measures the candidates at start-up
    # (inference/model/linear_plan.py); gemv, torch or onednn-prepacked forces one.
    linear_path: str = "auto"
    # Where linear_path=auto keeps its measured plans per machine and model shape, to load
    # them at the next start (inference/model/linear_plan_cache.py); None: measure at every start.
    linear_plan_dir: str | None = None
    linear_plan_refresh: bool = False  # measure even when a plan is kept, and keep the new one
    # a plan measured while other processes kept more CPUs busy than this is not kept
    linear_plan_busy_cpus: float = 0.3
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = 0  # for requests without their own seed
    # Structured output: check a constrained row's draws against its grammar before computing
    # its mask (the mask only when all are rejected; see model/sampler.py). False: mask every step.
    grammar_checks_first: bool = True
    # On the CPU: run each step on one thread or on torch's count, whichever its recent steps
    # of that shape were faster on (inference/engine/cpu_threads.py). False: always torch's count.
    adaptive_cpu_threads: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}",
                field="dtype",
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}",
                field="attention_backend",
            )
        if self.linear_path not in LINEAR_PATHS:
            raise InvalidRequestError(
                f"linear_path must be one of {', '.join(LINEAR_PATHS)}, got {self.linear_path!r}",
                field="linear_path",
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise InvalidRequestError(
                f"device must be auto, cpu or cuda[:N], got {self.device!r}", field="device"
            )
        if self.device.startswith("cuda"):
            _check_cuda_device(self.device)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(
                f"max_model_len must be >= 2, got {self.max_model_len}", field="max_model_len"
            )

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _check_cuda_device(device: str) -> None:
    """A CUDA device that this torch build cannot reach is a user error, said in one line."""
    if not torch.cuda.is_available():
        raise InvalidRequestError(
            f"device {device!r} was asked for, but torch {torch.__version__} sees no CUDA "
            "device (torch.cuda.is_available() is False); use --device cpu or auto",
            field="device",
        )
    _, _, index = device.partition(":")
    if index:
        count = torch.cuda.device_count()
        if not index.isdigit() or int(index) >= count:
            raise InvalidRequestError(
                f"device {device!r} does not exist; this machine has {count} CUDA device(s)",
                field="device",
            )
