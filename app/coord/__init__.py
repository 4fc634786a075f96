"""Coordination of what spans requests, processes and replicas: per-conversation turn locks,
idempotency records, stop signals (and, with Redis, rate limits and session leases). One
interface, two back ends: in-process (the embedded default) and Redis."""

from .base import Coordinator, IdempotencyRecord
from .local import LocalCoordinator

__all__ = ["Coordinator", "IdempotencyRecord", "LocalCoordinator"]
