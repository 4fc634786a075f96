"""Errors of the inference layer: those a user can cause (each message says what to change),
and the engine not running. Importing them costs nothing (no torch)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory, config field or tensor is missing or wrong."""


class GGUFImportError(ModelLoadError):
    """A GGUF file cannot be imported: truncated or malformed, or an architecture, tensor,
    quantization type or tokenizer kvchat does not support. The message names which."""


class InvalidRequestError(ValueError):
    """A request's parameter is out of range; `field` names it (for API error bodies)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine is not running (not started, shut down, or stopped on an internal error);
    no further requests are served and an open stream or a pending command cannot finish."""


class RequestFailedError(RuntimeError):
    """The engine could not compute this request (a step failed while it was in the batch); the
    request ends, its KV is dropped, and the engine goes on with the others."""
