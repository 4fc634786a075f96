"""Errors a user can cause in the inference layer; each message says what to change."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory, config field or tensor is missing or wrong."""


class InvalidRequestError(ValueError):
    """A request's parameter is out of range; `field` names it (for API error bodies)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code
