"""Messages: a tree per conversation (parent ids), read back as the branch to a leaf."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Unpack

from sqlalchemy import Exists, Select, delete, exists, literal_column, select, update
from sqlalchemy.orm import aliased

from kvchat.app.store.column_types import utcnow
from kvchat.app.store.errors import StaleFence
from kvchat.app.store.queries import bump_tree, first_scalar, has_message
from kvchat.app.store.records import (
    ROLES,
    STATUSES,
    ConversationRecord,
    MessageFields,
    MessageRecord,
    MessageUpdate,
    SummaryRecord,
)
from kvchat.app.store.store_base import StoreBase, check_fields
from kvchat.app.store.tables import (
    MESSAGE_TEXT,
    Conversation,
    Message,
    Summary,
    new_id,
    without_nul,
)

# start_reply(trim_start_id=NEW_USER): the history starts at the user message it adds.
NEW_USER = "<new user message>"

# Optional fields of add_message(); update_message() may also set status and content.
MESSAGE_FIELDS = (
    "name",
    "tool_calls",
    "tool_call_id",
    "num_tokens",
    "content_tokens",
    "token_ids",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "total_ms",
    "error",
    "response",
)
UPDATABLE_FIELDS = ("status", "content", *MESSAGE_FIELDS)
# The names checked at run time are the TypedDicts', which mypy checks callers against.
assert frozenset(MESSAGE_FIELDS) == MessageFields.__optional_keys__
assert frozenset(UPDATABLE_FIELDS) == MessageUpdate.__optional_keys__


class MessageStore(StoreBase):
    async def add_message(
        self,
        conversation_id: str,
        *,
        parent_id: str | None,
        role: str,
        content: str | None = None,
        status: str = "complete",
        move_leaf: bool = True,
        **fields: Unpack[MessageFields],
    ) -> MessageRecord:
        """Append a message under parent_id (None: a new root) and commit it; with move_leaf
        the conversation's current leaf becomes this message. LookupError for an unknown
        conversation, ValueError for a parent from elsewhere or a bad role or status."""
        (record,) = await self.add_chain(
            conversation_id,
            parent_id,
            [{"role": role, "content": content, "status": status, **fields}],
            move_leaf=move_leaf,
        )
        return record

    async def add_chain(
        self,
        conversation_id: str,
        parent_id: str | None,
        messages: Sequence[dict[str, Any]],
        *,
        move_leaf: bool,
    ) -> list[MessageRecord]:
        """Append `messages` (each: role, content, status ("complete" if absent) and
        MESSAGE_FIELDS) as a chain under parent_id (None: a new root), in one transaction
        (inserted in batches): all or none. With move_leaf the conversation's current leaf
        becomes the last one. Errors as add_message's."""
        if not messages:
            return []
        now = utcnow()
        rows, parent = [], parent_id
        for i, m in enumerate(messages):
            fields = {k: v for k, v in m.items() if k not in ("role", "content", "status")}
            check_fields(fields, MESSAGE_FIELDS)
            if m["role"] not in ROLES:
                raise ValueError(f"role must be one of {', '.join(ROLES)}, got {m['role']!r}")
            status = m.get("status", "complete")
            _check_status(status)
            # Apart by a microsecond each: whatever lists by creation time keeps their order.
            created = now + timedelta(microseconds=i)
            row = Message(
                id=new_id("msg_"),
                conversation_id=conversation_id,
                parent_id=parent,
                role=m["role"],
                content=m.get("content"),
                status=status,
                created_at=created,
                updated_at=created,
                **_json_ready(fields),
            )
            rows.append(row)
            parent = row.id
        async with self._write() as session:
            conversation = await session.get(Conversation, conversation_id)
            if conversation is None:
                raise LookupError(f"no conversation {conversation_id!r}")
            if parent_id is not None and not await has_message(session, conversation_id, parent_id):
                raise ValueError(f"parent {parent_id!r} is not a message of {conversation_id}")
            await bump_tree(session, conversation_id, conversation)
            session.add_all(rows)
            if move_leaf:
                conversation.current_leaf_id = rows[-1].id
                conversation.updated_at = now
            await session.flush()
            return [MessageRecord.of(row) for row in rows]

    async def remove_chain(self, conversation_id: str, message_ids: Sequence[str]) -> None:
        """Take out messages that nothing else hangs from but each other (a request's input
        that did not start): their links cut first, so no cascade recurses down the chain."""
        if not message_ids:
            return
        ids = list(message_ids)
        async with self._write() as session:
            conversation = await session.get(Conversation, conversation_id)
            if conversation is None:
                return
            await bump_tree(session, conversation_id, conversation)
            await session.execute(
                update(Message)
                .where(Message.conversation_id == conversation_id, Message.id.in_(ids))
                .values(parent_id=None)
            )
            await session.execute(
                delete(Message).where(
                    Message.conversation_id == conversation_id, Message.id.in_(ids)
                )
            )
            if conversation.current_leaf_id in ids:
                conversation.current_leaf_id = None
            if conversation.trim_start_id in ids:
                conversation.trim_start_id = None

    async def update_message(
        self, message_id: str, **fields: Unpack[MessageUpdate]
    ) -> MessageRecord:
        """Set any of UPDATABLE_FIELDS and bump updated_at; LookupError for an unknown id.
        One statement (UPDATE ... RETURNING): a turn writes its reply with it, checkpoints
        included."""
        check_fields(fields, UPDATABLE_FIELDS)
        if "status" in fields:
            _check_status(fields["status"])
        values = _json_ready(fields)
        for name in MESSAGE_TEXT:
            if name in values:
                values[name] = without_nul(values[name])
        async with self._write() as session:
            row = await first_scalar(
                session,
                update(Message)
                .where(Message.id == message_id)
                .values(**values, updated_at=utcnow())
                .returning(Message)
                .execution_options(populate_existing=True),
            )
            if row is None:
                raise LookupError(f"no message {message_id!r}")
            return MessageRecord.of(row)

    async def get_message(self, conversation_id: str, message_id: str) -> MessageRecord | None:
        async with self._read() as session:
            row = await first_scalar(
                session,
                select(Message).where(
                    Message.id == message_id, Message.conversation_id == conversation_id
                ),
            )
            return None if row is None else MessageRecord.of(row)

    async def owned_message(
        self, owner: str, message_id: str
    ) -> tuple[ConversationRecord, MessageRecord] | None:
        """A message by its id alone, with its conversation, if that belongs to `owner`
        (another owner's message reads as a missing one): one query."""
        async with self._read() as session:
            found = (
                await session.execute(
                    select(Conversation, Message)
                    .join(Message, Conversation.id == Message.conversation_id)
                    .where(Message.id == message_id, Conversation.owner == owner)
                )
            ).first()
            if found is None:
                return None
            return ConversationRecord.of(found[0]), MessageRecord.of(found[1])

    async def delete_message(self, conversation_id: str, message_id: str) -> bool:
        """Take one message out of its conversation's tree, keeping the rest: its children
        move up to its parent, the conversation's leaf and trim start move off it. False when
        there is no such message."""
        async with self._write() as session:
            row = await first_scalar(
                session,
                select(Message).where(
                    Message.id == message_id, Message.conversation_id == conversation_id
                ),
            )
            if row is None:
                return False
            conversation = await session.get(Conversation, conversation_id)
            assert conversation is not None  # messages cascade with their conversation
            await bump_tree(session, conversation_id, conversation)
            now = utcnow()
            await session.execute(
                update(Message)
                .where(Message.conversation_id == conversation_id, Message.parent_id == message_id)
                .values(parent_id=row.parent_id, updated_at=now)
            )
            if conversation.current_leaf_id == message_id:
                conversation.current_leaf_id = row.parent_id
            if conversation.trim_start_id == message_id:
                conversation.trim_start_id = None
            conversation.updated_at = now
            await session.flush()
            await session.delete(row)
            return True

    async def branch(self, conversation_id: str, leaf_id: str | None) -> list[MessageRecord]:
        """The path root..leaf, in order: one recursive query. Empty when leaf_id is None or
        not a message of this conversation."""
        if leaf_id is None:
            return []
        async with self._read() as session:
            return [
                MessageRecord.of(row)
                for row in await session.scalars(_branch_query(conversation_id, leaf_id))
            ]

    async def turn_context(
        self, conversation_id: str, leaf_id: str | None
    ) -> tuple[list[MessageRecord], SummaryRecord | None]:
        """What a turn is planned from, in one read: the branch root..leaf (as branch()) and
        the conversation's latest summary."""
        summary_query = (
            select(Summary)
            .where(Summary.conversation_id == conversation_id)
            .order_by(Summary.created_at.desc(), Summary.id.desc())
            .limit(1)
        )
        async with self._read() as session:
            branch = (
                []
                if leaf_id is None
                else [
                    MessageRecord.of(row)
                    for row in await session.scalars(_branch_query(conversation_id, leaf_id))
                ]
            )
            summary = await first_scalar(session, summary_query)
            return branch, None if summary is None else SummaryRecord.of(summary)

    async def start_reply(
        self,
        conversation_id: str,
        *,
        parent_id: str | None,
        user: dict[str, Any] | None,
        trim_start_id: str | None,
        fence: int | None = None,
        reply: dict[str, Any] | None = None,
    ) -> tuple[MessageRecord | None, MessageRecord]:
        """A turn's writes before generation, in one transaction: the user's message (fields as
        add_message's, under parent_id) when there is one, the assistant's reply under it with
        status `generating`, the conversation's leaf moved to the reply and its trim start set
        (NEW_USER: the user message added here). Returns (user message, reply).

        `fence`: the turn lock's fence. It must be above the conversation's `turn_fence`
        (StaleFence otherwise: a newer lock holder started a turn since) and becomes it; and
        since the caller holds the turn lock, any reply still `generating` in the conversation
        is a dead turn's: it becomes `interrupted`. LookupError for an unknown conversation.

        `reply`: further fields of the reply (as add_message's), e.g. `response`."""
        reply_fields = dict(reply or {})
        check_fields(reply_fields, MESSAGE_FIELDS)
        now = utcnow()
        rows: list[Message] = []
        if user is not None:
            fields = dict(user)
            role, content = fields.pop("role"), fields.pop("content", None)
            check_fields(fields, MESSAGE_FIELDS)
            if role not in ROLES:
                raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
            rows.append(
                Message(
                    id=new_id("msg_"),
                    conversation_id=conversation_id,
                    parent_id=parent_id,
                    role=role,
                    content=content,
                    status="complete",
                    created_at=now,
                    updated_at=now,
                    **_json_ready(fields),
                )
            )
        # One microsecond later than the user's message: messages() lists a tree in creation
        # order, parents first.
        reply_at = now + timedelta(microseconds=1) if rows else now
        rows.append(
            Message(
                id=new_id("msg_"),
                conversation_id=conversation_id,
                parent_id=rows[0].id if rows else parent_id,
                role="assistant",
                content=None,
                status="generating",
                created_at=reply_at,
                updated_at=reply_at,
                **_json_ready(reply_fields),
            )
        )
        if trim_start_id == NEW_USER:
            trim_start_id = rows[0].id if user is not None else None
        new_ids = {r.id for r in rows}
        # One statement moves the conversation on (its leaf, trim start, fence and tree
        # version) and checks what the turn relies on: the fence is newer than the last one,
        # the parent and the trim start are messages of this conversation.
        where = [Conversation.id == conversation_id]
        values: dict[str, Any] = dict(
            current_leaf_id=rows[-1].id,
            trim_start_id=trim_start_id,
            updated_at=now,
            tree_version=Conversation.tree_version + 1,
        )
        if fence is not None:
            where.append(Conversation.turn_fence < fence)
            values["turn_fence"] = fence
        if parent_id is not None:
            where.append(_message_of(conversation_id, parent_id))
        if trim_start_id is not None and trim_start_id not in new_ids:
            where.append(_message_of(conversation_id, trim_start_id))
        async with self._write() as session:
            moved = await first_scalar(
                session,
                update(Conversation)
                .where(*where)
                .values(**values)
                .returning(Conversation.tree_version)
                .execution_options(synchronize_session=False),
            )
            if moved is None:  # which check failed (a refused turn: the slow path is fine)
                conversation = await session.get(Conversation, conversation_id)
                if conversation is None:
                    raise LookupError(f"no conversation {conversation_id!r}")
                if fence is not None and conversation.turn_fence >= fence:
                    raise StaleFence(f"the turn lock of {conversation_id} was taken over")
                if parent_id is not None and not await has_message(
                    session, conversation_id, parent_id
                ):
                    raise ValueError(f"parent {parent_id!r} is not a message of {conversation_id}")
                raise ValueError(f"trim_start_id: no message {trim_start_id!r}")
            if fence is not None:  # the caller holds the turn lock: a generating reply is dead
                await session.execute(
                    update(Message)
                    .where(
                        Message.conversation_id == conversation_id, Message.status == "generating"
                    )
                    .values(status="interrupted", updated_at=now)
                    .execution_options(synchronize_session=False)
                )
            session.add_all(rows)
            await session.flush()
            records = [MessageRecord.of(r) for r in rows]
            return (records[0] if user is not None else None), records[-1]

    async def messages(self, conversation_id: str) -> list[MessageRecord]:
        """The whole tree in creation order (parents before children)."""
        query = (
            select(Message)
            .where(Message.conversation_id == conversation_id)
            .order_by(Message.created_at, Message.id)
        )
        async with self._read() as session:
            return [MessageRecord.of(row) for row in await session.scalars(query)]

    async def children(self, conversation_id: str, parent_id: str | None) -> list[MessageRecord]:
        """The messages under parent_id (None: the roots), oldest first: the siblings a client
        switches between."""
        under = Message.parent_id.is_(None) if parent_id is None else Message.parent_id == parent_id
        query = (
            select(Message)
            .where(Message.conversation_id == conversation_id, under)
            .order_by(Message.created_at, Message.id)
        )
        async with self._read() as session:
            return [MessageRecord.of(row) for row in await session.scalars(query)]

    async def mark_interrupted(
        self,
        *,
        except_conversations: Collection[str] = (),
        created_before: datetime | None = None,
    ) -> list[MessageRecord]:
        """After a crash: every message still `generating` becomes `interrupted`, except in
        the conversations named (whose replies another live process is generating) and,
        with `created_before`, those created since (a turn another process began after the
        caller looked at who is live). One conditional statement: a reply that a live turn
        completes meanwhile keeps its status. Returns the messages as they are now."""
        where = [Message.status == "generating"]
        if except_conversations:
            where.append(Message.conversation_id.not_in(list(except_conversations)))
        if created_before is not None:
            where.append(Message.created_at < created_before)
        async with self._write() as session:
            rows = await session.scalars(
                update(Message)
                .where(*where)
                .values(status="interrupted", updated_at=utcnow())
                .returning(Message)
                .execution_options(populate_existing=True)
            )
            return sorted(
                (MessageRecord.of(row) for row in rows), key=lambda m: (m.created_at, m.id)
            )


def _message_of(conversation_id: str, message_id: str) -> Exists:
    """SQL: message_id is a message of the conversation."""
    return exists().where(Message.id == message_id, Message.conversation_id == conversation_id)


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")


def _json_ready(fields: Mapping[str, object]) -> dict[str, Any]:
    """Column values for a statement or a row (any value, as SQLAlchemy takes them): token_ids
    and tool_calls as JSON lists (a caller may hold tuples)."""
    out: dict[str, Any] = dict(fields)
    for name in ("token_ids", "tool_calls"):
        if out.get(name) is not None:
            out[name] = list(out[name])
    return out


def _branch_query(conversation_id: str, leaf_id: str) -> Select[Message]:
    """Messages root..leaf_id, in order: one recursive query."""
    path = (
        select(Message.id, Message.parent_id, literal_column("0").label("depth"))
        .where(Message.id == leaf_id, Message.conversation_id == conversation_id)
        .cte("path", recursive=True)
    )
    parent = aliased(Message)
    path = path.union_all(
        select(parent.id, parent.parent_id, path.c.depth + literal_column("1")).where(
            parent.id == path.c.parent_id, parent.conversation_id == conversation_id
        )
    )
    return select(Message).join(path, Message.id == path.c.id).order_by(path.c.depth.desc())
