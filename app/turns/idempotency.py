"""Idempotent turns for the REST routes that take an `Idempotency-Key` (as Stripe and OpenAI's
SDK retries use it): the first request with a key runs; a retry with the same key and body
gets the first one's reply instead of a second turn; a retry with another body is a 400.

Each attempt records who runs it (its process, as locks name one) and, once its turn started,
its turn lock's token and the user message it stored. A retry of an attempt still running
waits for its reply; of one whose process died (its turn lock gone without a result, or its
process known dead), it takes the record over and re-runs it: a reply to the user message
the dead attempt already stored (the interrupted reply stays beside it as a sibling), or the
whole request when nothing was stored. An attempt whose turn lost its lock (its process hung
past the lock's TTL) counts as dead: its cut-off reply is never replayed. A retry never waits
on a dead attempt longer than the turn lock's TTL, so it always gets an answer within seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvchat.app.coord import IdempotencyRecord
from kvchat.app.errors import APIError, invalid_request, not_found
from kvchat.app.store import MessageRecord
from kvchat.app.turns.service import EndHook, TurnService, lock_key
from kvchat.app.turns.turn import Turn

IDEMPOTENCY_TTL = 24 * 3600.0
POLL_S = 0.05
MAX_WAIT_S = 3600.0  # a live first attempt is waited for at most this long (then 409)

Start = Callable[[EndHook], Awaitable[Turn]]
Rerun = Callable[[str, EndHook], Awaitable[Turn]]


@dataclass(frozen=True)
class Replayed:
    """The stored reply of an earlier request with the same Idempotency-Key."""

    message: MessageRecord


def fingerprint(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


async def run_once(
    turns: TurnService,
    owner: str,
    conversation_id: str,
    idempotency_key: str | None,
    body: dict[str, Any],
    start: Start,
    rerun: Rerun,
) -> Turn | Replayed:
    """Run `start` (a new turn) unless a request with this key ran or runs already. `rerun`
    regenerates the reply to a stored user message (a retry of an attempt that died after
    storing it)."""
    if idempotency_key is None:
        return await start(_nothing)
    if not 1 <= len(idempotency_key) <= 255:
        raise invalid_request("Idempotency-Key must be 1-255 characters", "Idempotency-Key")
    name = f"idem:{owner}:{conversation_id}:{idempotency_key}"  # conversation_id: or a scope
    digest = fingerprint(body)
    coord = turns.coord
    attempt = {
        "id": uuid.uuid4().hex,
        "began": time.time(),
        "conversation_id": conversation_id,
        **turns.identity.process(),
    }
    deadline = time.monotonic() + MAX_WAIT_S
    while True:
        first = await coord.idempotency_begin(name, digest, IDEMPOTENCY_TTL, attempt)
        if first is None:
            return await _attempt(turns, name, attempt, start)
        if first.fingerprint != digest:
            raise invalid_request(
                "this Idempotency-Key was used with a different request body",
                "Idempotency-Key",
                code="idempotency_key_reused",
            )
        if first.is_done:
            return Replayed(await _stored(turns, first))
        if await _alive(turns, first.attempt):
            if time.monotonic() > deadline:
                raise APIError(
                    409,
                    "The first request with this Idempotency-Key is still running.",
                    code="conversation_busy",
                )
            await asyncio.sleep(POLL_S)
            continue
        taken = await coord.idempotency_takeover(name, str(first.attempt.get("id", "")), attempt)
        if taken is None:
            continue  # it finished or another retry took it over meanwhile: look again
        user_message_id = first.attempt.get("user_message_id")
        if isinstance(user_message_id, str):
            return await _attempt(turns, name, attempt, _bound(rerun, user_message_id))
        return await _attempt(turns, name, attempt, start)


async def _attempt(turns: TurnService, name: str, attempt: dict[str, Any], start: Start) -> Turn:
    coord = turns.coord

    async def finished(turn: Turn) -> None:
        if turn.lock_lost:  # cut off: a retry takes it over as from a dead attempt
            await coord.idempotency_progress(name, attempt["id"], {"lost": True})
        elif turn.final is not None:
            await coord.idempotency_finish(
                name,
                {"message_id": turn.final.id, "conversation_id": turn.conversation_id},
                IDEMPOTENCY_TTL,
                attempt["id"],
            )
        else:  # nothing to replay: a retry starts afresh
            await coord.idempotency_abandon(name, attempt["id"])

    try:
        turn = await start(finished)
    except BaseException:
        await coord.idempotency_abandon(name, attempt["id"])
        raise
    await coord.idempotency_progress(
        name,
        attempt["id"],
        {
            "lock": turn.lock_token,
            # The conversation the turn runs in (a Responses request may have created it).
            "conversation_id": turn.conversation_id,
            "user_message_id": turn.user_message.id if turn.user_message else None,
            "reply_id": turn.message_id,
        },
    )
    return turn


async def _alive(turns: TurnService, attempt: dict[str, Any]) -> bool:
    """Whether the attempt that runs a record can still finish it."""
    if attempt.get("lost") or turns.identity.is_dead(attempt):
        return False
    lock = attempt.get("lock")
    if isinstance(lock, str):
        holder = await turns.coord.lock_holder(lock_key(str(attempt.get("conversation_id"))))
        return holder is not None and holder.token == lock
    # Not started yet (or died starting): its turn lock would be held within a moment.
    began = attempt.get("began")
    return isinstance(began, int | float) and time.time() - began < turns.settings.turn_lock_ttl


async def _stored(turns: TurnService, record: IdempotencyRecord) -> MessageRecord:
    result = record.result or {}
    message = await turns.store.get_message(
        str(result.get("conversation_id")), str(result.get("message_id"))
    )
    if message is None:
        raise not_found("the reply of the first request with this Idempotency-Key")
    return message


def _bound(rerun: Rerun, user_message_id: str) -> Start:
    return lambda on_end: rerun(user_message_id, on_end)


async def _nothing(turn: Turn) -> None:
    return None
