"""A conversation's session as its WebSockets see it, told to the engine's retention policy
(memory/retention.py; the session's id is the conversation's): present while a socket of it is
open in this process, noted when the first opens and when the last closes; its user typing, a
hint a chat page sends while its user writes (the session's KV comes back onto the device at
once, so the message finds it there), noted at most once per TYPING_NOTE_INTERVAL_S per socket,
the rest accepted and ignored. Notes are hints: a stopped engine has nothing to hold, and
nothing is said."""

from __future__ import annotations

import asyncio
import contextlib
import time

from kvchat.app.deps import AppState
from kvchat.inference import EngineDeadError

# A socket's typing frames closer together than this are accepted and ignored.
TYPING_NOTE_INTERVAL_S = 1.0


def arrive(state: AppState, conversation_id: str) -> asyncio.Task[None] | None:
    """A socket of the conversation opened: the note that its session is present, when it is
    the first (await it before reading the socket's frames)."""
    return _note_presence(state, conversation_id) if _count(state, conversation_id, 1) else None


def leave(state: AppState, conversation_id: str) -> asyncio.Task[None] | None:
    """A socket of the conversation closed: the note that its session is no longer present,
    when it was the last. Called before anything of the closing handler is awaited: a handler
    cancelled as its socket closes (a client gone as the server stops) still has it noted."""
    return _note_presence(state, conversation_id) if _count(state, conversation_id, -1) else None


def _count(state: AppState, conversation_id: str, change: int) -> bool:
    """Count a socket of the conversation opened (+1) or closed (-1); whether its presence
    changed (the first opened, or the last closed)."""
    sockets = state.conversation_sockets
    count = sockets.get(conversation_id, 0) + change
    assert count >= 0, (conversation_id, count)
    if count:
        sockets[conversation_id] = count
    else:
        sockets.pop(conversation_id, None)
    return count == (1 if change > 0 else 0)


def _note_presence(state: AppState, conversation_id: str) -> asyncio.Task[None]:
    """Whether the conversation has a socket open, as it is now, in a background task (it
    outlives a cancelled handler). Tasks start in the order they are made, so notes that cross
    (the last socket closing as a new one opens) leave the last word to the truth."""
    return state.tasks.spawn(
        _note(state, conversation_id, present=conversation_id in state.conversation_sockets)
    )


async def note_typing(state: AppState, conversation_id: str) -> None:
    """Its user is typing: the engine brings the session's KV back onto the device."""
    await _note(state, conversation_id, typing=True)


async def _note(
    state: AppState, conversation_id: str, *, present: bool | None = None, typing: bool = False
) -> None:
    with contextlib.suppress(EngineDeadError):
        await state.runtime.engine_client.note_session(
            conversation_id, present=present, typing=typing
        )


class TypingPace:
    """One socket's typing notes: at most one per TYPING_NOTE_INTERVAL_S."""

    def __init__(self) -> None:
        self.noted_at: float | None = None

    def due(self) -> bool:
        """Whether a typing frame now is to be noted (and it counts as noted)."""
        now = time.monotonic()
        if self.noted_at is not None and now - self.noted_at < TYPING_NOTE_INTERVAL_S:
            return False
        self.noted_at = now
        return True
