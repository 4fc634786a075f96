"""Summaries of dropped messages; the newest per conversation is its running summary."""

from __future__ import annotations

from sqlalchemy import select

from kvchat.app.store.column_types import utcnow
from kvchat.app.store.queries import bump_tree, first_scalar
from kvchat.app.store.records import SummaryRecord
from kvchat.app.store.store_base import StoreBase
from kvchat.app.store.tables import Conversation, Summary, new_id


class SummaryStore(StoreBase):
    async def add_summary(
        self, conversation_id: str, *, text: str, num_tokens: int, covers: list[str]
    ) -> SummaryRecord:
        """Store a summary covering these message ids (oldest first); LookupError for an
        unknown conversation."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        row = Summary(
            id=new_id("sum_"),
            conversation_id=conversation_id,
            text=text,
            num_tokens=num_tokens,
            covers=list(covers),
            created_at=utcnow(),
        )
        async with self._write() as session:
            if await session.get(Conversation, conversation_id) is None:
                raise LookupError(f"no conversation {conversation_id!r}")
            await bump_tree(session, conversation_id)
            session.add(row)
            await session.flush()
            return SummaryRecord.of(row)

    async def latest_summary(self, conversation_id: str) -> SummaryRecord | None:
        query = (
            select(Summary)
            .where(Summary.conversation_id == conversation_id)
            .order_by(Summary.created_at.desc(), Summary.id.desc())
            .limit(1)
        )
        async with self._read() as session:
            row = await first_scalar(session, query)
            return None if row is None else SummaryRecord.of(row)
