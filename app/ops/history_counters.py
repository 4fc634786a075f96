"""HistoryCounters: what history planning did, per session and over all of them (trims,
dropped tokens, tool results capped, summaries, turns run in sink + window mode). The service
is their only writer, as it plans turns, stores summaries and sees a turn's final output; the
operator routes and the metrics read them. The engine counts none of it: it is the service's
knowledge (the engine only reports, on a turn's final output, whether its window applied)."""

from __future__ import annotations

import dataclasses
import threading

from kvchat.memory import HistoryStats


class HistoryCounters:
    """Thread-safe (a lock around each read and write): the event loop writes, and a reader
    on another thread sees whole updates."""

    def __init__(self) -> None:
        self._total = HistoryStats()
        self._sessions: dict[str, HistoryStats] = {}
        self._lock = threading.Lock()

    def record(self, session_id: str, event: HistoryStats) -> None:
        with self._lock:
            self._sessions.setdefault(session_id, HistoryStats()).add(event)
            self._total.add(event)

    def session(self, session_id: str) -> HistoryStats:
        """A copy of one session's counters (zeros for a session never counted)."""
        with self._lock:
            return dataclasses.replace(self._sessions.get(session_id, HistoryStats()))

    def total(self) -> HistoryStats:
        """A copy of the counters summed over every session (forgotten ones included)."""
        with self._lock:
            return dataclasses.replace(self._total)

    def forget(self, session_id: str) -> None:
        """A deleted conversation's counters go; the totals keep what it did."""
        with self._lock:
            self._sessions.pop(session_id, None)
