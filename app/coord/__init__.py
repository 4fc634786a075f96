"""Coordination of what spans requests, processes and replicas: per-conversation turn locks,
idempotency records, stop signals, rate limits, session ownership leases and the buffered
events of replies. One interface, two back ends: in-process (the embedded default) and Redis
(`KVCHAT_REDIS_URL`)."""

from kvchat.app.coord.base import (
    Coordinator,
    IdempotencyRecord,
    LockHolder,
    ProcessIdentity,
    RateDecision,
)
from kvchat.app.coord.local import LocalCoordinator


def make_coordinator(redis_url: str | None, prefix: str = "kvchat:") -> Coordinator:
    if redis_url is None:
        return LocalCoordinator()
    from kvchat.app.coord.redis import RedisCoordinator

    return RedisCoordinator(redis_url, prefix=prefix)


__all__ = [
    "Coordinator",
    "IdempotencyRecord",
    "LocalCoordinator",
    "LockHolder",
    "ProcessIdentity",
    "RateDecision",
    "make_coordinator",
]
