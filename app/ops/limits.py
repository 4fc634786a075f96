"""Per-key rate limits (requests and tokens per minute, sliding window) through the
coordination back end: 429 with `Retry-After` and OpenAI's `x-ratelimit-*` headers on REST,
an error frame `rate_limited` with `retry_after` on the WebSocket."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from kvchat.app.coord import Coordinator, RateDecision
from kvchat.app.errors import APIError, unavailable
from kvchat.app.ops.metrics import Metrics
from kvchat.app.ops.tasks import BackgroundTasks
from kvchat.app.settings import Settings
from kvchat.app.store import KeyRecord

WINDOW_S = 60.0


class Counted(Protocol):
    """A finished generation, as its key's token limit counts it."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...


def _headers(kind: str, decision: RateDecision) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(decision.limit),
        f"x-ratelimit-remaining-{kind}": str(decision.remaining),
        f"x-ratelimit-reset-{kind}": f"{decision.reset_s:.1f}s",
    }


class Limits:
    """Admission: each key's rate limits and the engine's queue (every transport's)."""

    def __init__(
        self,
        settings: Settings,
        coord: Coordinator,
        metrics: Metrics,
        queued: Callable[[], int],
        tasks: BackgroundTasks,
    ) -> None:
        self.settings = settings
        self.coord = coord
        self.metrics = metrics
        self.queued = queued  # requests waiting in the engine, as of its latest step
        self.tasks = tasks

    async def admit(self, key: KeyRecord) -> dict[str, str]:
        """Count one request against the key's limits; raise 429 when over. Returns the
        x-ratelimit headers for the response."""
        settings = self.settings
        headers: dict[str, str] = {}
        checks: list[tuple[str, str, int, int]] = []
        if settings.rate_limit_requests:
            checks.append(("requests", f"requests:{key.id}", settings.rate_limit_requests, 1))
        if settings.rate_limit_tokens:
            # Tokens are counted after the fact; a request is refused once the window is spent.
            checks.append(("tokens", f"tokens:{key.id}", settings.rate_limit_tokens, 1))
        for kind, bucket, limit, cost in checks:
            decision = await self.coord.rate_check(
                bucket, limit, WINDOW_S, cost if kind == "requests" else 0
            )
            if kind == "tokens" and decision.remaining <= 0:
                decision = RateDecision(
                    False, limit, 0, decision.reset_s, max(decision.reset_s, 1.0)
                )
            headers.update(_headers(kind, decision))
            if not decision.allowed:
                self.metrics.rate_limited.inc()
                retry = max(1, math.ceil(decision.retry_after))
                raise APIError(
                    429,
                    f"Rate limit reached for {kind} per minute ({limit}); retry in {retry} s.",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry), **headers},
                )
        return headers

    async def spend_tokens(self, key_id: str, tokens: int) -> None:
        if self.settings.rate_limit_tokens and tokens > 0:
            await self.coord.rate_add(f"tokens:{key_id}", WINDOW_S, tokens)

    def spend_on_finish(self, key_id: str) -> Callable[[Counted], None]:
        """A generation's on_finish: count its tokens against its key's tokens-per-minute
        limit."""

        def finished(result: Counted) -> None:
            tokens = result.prompt_tokens + result.completion_tokens
            self.tasks.spawn(self.spend_tokens(key_id, tokens))

        return finished

    def check_capacity(self) -> None:
        """503 with Retry-After while the engine has more queued requests than the setting
        allows."""
        if self.queued() >= self.settings.max_queued_requests:
            raise unavailable("The server is at capacity (too many queued requests).", 2)


def rate_limit_frame(error: APIError) -> dict[str, Any]:
    return {
        "type": "error",
        "code": "rate_limited",
        "message": error.message,
        "retry_after": int(error.headers.get("Retry-After", "1")),
    }
