"""Conversations: owner scoping, newest-first cursor pages, updates, cascading deletes."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvchat.app.store import OVERRIDE_FIELDS, ConversationRecord, Store

pytestmark = pytest.mark.anyio
METADATA = {
    "tag": "résumé ✓",
    "nul": "a\x00b",
    "": "",
    "nested": {"emoji": "🦙", "list": [1, 2.5, None]},
}
OVERRIDES = dict(
    max_context_tokens=4096,
    max_kv_tokens=8192,
    history_policy="summarize",
    high_watermark=0.75,
    low_watermark=0.5,
    max_tool_result_tokens=256,
    max_summary_tokens=128,
    retention_ttl_s=5400.25,
    retention_priority=85,
)


async def test_create_and_get_round_trip_every_field(store: Store) -> None:
    created = await store.create_conversation(
        "alice", title="Über 東京", system_prompt="Be brief.\n", metadata=METADATA, **OVERRIDES
    )
    assert created.id.startswith("conv_") and created.owner == "alice"
    assert created.metadata == METADATA and created.overrides == OVERRIDES
    assert created.created_at == created.updated_at and created.created_at.tzinfo is not None
    assert created.current_leaf_id is None and created.trim_start_id is None
    assert await store.get_conversation("alice", created.id) == created

    bare = await store.create_conversation("alice")
    assert (bare.title, bare.system_prompt, bare.metadata, bare.overrides) == (None, None, {}, {})
    assert set(OVERRIDE_FIELDS) == set(OVERRIDES)
    with pytest.raises(TypeError, match="max_tokens"):
        await store.create_conversation("alice", max_tokens=3)
    with pytest.raises(ValueError, match="JSON object"):
        await store.create_conversation("alice", metadata=[1, 2])  # type: ignore[arg-type]


async def test_another_owners_conversation_reads_as_missing(store: Store) -> None:
    mine = await store.create_conversation("alice", title="mine")
    await store.add_message(mine.id, parent_id=None, role="user", content="hi")
    before = await store.get_conversation("alice", mine.id)
    assert await store.get_conversation("mallory", mine.id) is None
    assert await store.update_conversation("mallory", mine.id, title="pwned") is None
    assert await store.delete_conversation("mallory", mine.id) is False
    assert await store.list_conversations("mallory") == ([], None)
    # ...and exactly as a missing id does
    assert await store.get_conversation("alice", "conv_missing") is None
    assert await store.update_conversation("alice", "conv_missing", title="x") is None
    assert await store.delete_conversation("alice", "conv_missing") is False
    assert await store.get_conversation("alice", mine.id) == before
    assert len(await store.messages(mine.id)) == 1


async def _all_pages(store: Store, owner: str, limit: int) -> list[list[ConversationRecord]]:
    pages: list[list[ConversationRecord]] = []
    cursor: str | None = None
    while True:
        page, cursor = await store.list_conversations(owner, limit=limit, after=cursor)
        pages.append(page)
        if cursor is None:
            return pages
        assert len(pages) < 100


async def test_pages_are_newest_first_without_gaps_or_duplicates(
    store: Store, run_sql: Callable[..., Any]
) -> None:
    ids = [(await store.create_conversation("alice", title=str(i))).id for i in range(45)]
    await store.create_conversation("bob")
    # Shuffled timestamps, a run of 10 of them equal: order is (created_at, id), both desc.
    base = datetime(2025, 1, 1, tzinfo=UTC)
    stamps = [base + timedelta(seconds=s) for s in random.sample(range(1000), 45)]
    stamps[5:15] = [base + timedelta(seconds=500, microseconds=123)] * 10
    for conversation_id, stamp in zip(ids, stamps):
        await run_sql(
            store.url,
            "UPDATE conversations SET created_at = :t WHERE id = :id",
            t=stamp,
            id=conversation_id,
        )
    expected = [i for _, i in sorted(zip(stamps, ids), reverse=True)]

    pages = await _all_pages(store, "alice", 20)
    assert [len(p) for p in pages] == [20, 20, 5]
    assert [c.id for p in pages for c in p] == expected
    assert all(c.owner == "alice" for p in pages for c in p)
    for limit, sizes in ((45, [45]), (44, [44, 1]), (46, [45]), (1, [1] * 45)):
        pages = await _all_pages(store, "alice", limit)
        assert [len(p) for p in pages] == sizes
        assert [c.id for p in pages for c in p] == expected

    # a cursor stays valid when its conversation is deleted in between
    first, cursor = await store.list_conversations("alice", limit=20)
    assert await store.delete_conversation("alice", first[-1].id)
    rest, _ = await store.list_conversations("alice", limit=30, after=cursor)
    assert [c.id for c in rest] == expected[20:45]


async def test_list_rejects_bad_cursors_and_limits(store: Store) -> None:
    for cursor in ("garbage!", "", "bm90LWEtY3Vyc29y", "MjAyNS0wMS0wMXxjb252X3g"):
        with pytest.raises(ValueError, match="cursor"):
            await store.list_conversations("alice", after=cursor)
    for limit in (0, -1, 1001):
        with pytest.raises(ValueError, match="limit"):
            await store.list_conversations("alice", limit=limit)


async def test_update_sets_fields_clears_with_none_and_bumps_updated_at(store: Store) -> None:
    created = await store.create_conversation("alice", title="old", max_kv_tokens=10)
    message = await store.add_message(created.id, parent_id=None, role="user", content="q")
    updated = await store.update_conversation(
        "alice",
        created.id,
        title="new",
        metadata={"k": "v"},
        max_kv_tokens=None,
        history_policy="drop",
        trim_start_id=message.id,
        current_leaf_id=message.id,
        retention_ttl_s=0.0,
        retention_priority=0,
    )
    assert updated is not None
    assert (updated.title, updated.metadata, updated.max_kv_tokens) == ("new", {"k": "v"}, None)
    # zero is a setting (hold nothing, rank lowest), not the default
    assert (updated.retention_ttl_s, updated.retention_priority) == (0.0, 0)
    assert updated.overrides["retention_priority"] == 0
    assert updated.history_policy == "drop" and updated.trim_start_id == message.id
    assert updated.updated_at > created.updated_at and updated.created_at == created.created_at
    assert await store.get_conversation("alice", created.id) == updated

    other = await store.create_conversation("alice")
    foreign = await store.add_message(other.id, parent_id=None, role="user", content="x")
    for field in ("current_leaf_id", "trim_start_id"):
        with pytest.raises(ValueError, match=field):
            await store.update_conversation("alice", created.id, **{field: foreign.id})
    with pytest.raises(TypeError, match="created_at"):
        await store.update_conversation("alice", created.id, created_at=created.updated_at)
    cleared = await store.update_conversation("alice", created.id, current_leaf_id=None)
    assert cleared is not None and cleared.current_leaf_id is None


async def test_delete_cascades_to_messages_and_summaries(
    store: Store, run_sql: Callable[..., Any]
) -> None:
    doomed = await store.create_conversation("alice")
    kept = await store.create_conversation("alice")
    for conversation in (doomed, kept):
        parent = None
        for i in range(4):
            parent = (
                await store.add_message(
                    conversation.id,
                    parent_id=parent,
                    role="user" if i % 2 == 0 else "assistant",
                    content=str(i),
                )
            ).id
        await store.add_summary(conversation.id, text="s", num_tokens=1, covers=[])

    assert await store.delete_conversation("alice", doomed.id) is True
    assert await store.get_conversation("alice", doomed.id) is None
    assert await store.delete_conversation("alice", doomed.id) is False
    counts = await run_sql(
        store.url,
        """
        SELECT (SELECT count(*) FROM messages WHERE conversation_id = :d) AS doomed_messages,
               (SELECT count(*) FROM summaries WHERE conversation_id = :d) AS doomed_summaries,
               (SELECT count(*) FROM messages WHERE conversation_id = :k) AS kept_messages,
               (SELECT count(*) FROM summaries WHERE conversation_id = :k) AS kept_summaries
    """,
        d=doomed.id,
        k=kept.id,
    )
    assert counts == [
        dict(doomed_messages=0, doomed_summaries=0, kept_messages=4, kept_summaries=1)
    ]


async def test_a_conversation_of_any_length_can_be_deleted(store: Store) -> None:
    """A branch of 5,000 messages (a long agent loop): SQLite's recursive foreign-key actions
    stop at a depth of 1,000, so a delete that walks the tree by cascade fails there."""
    from sqlalchemy import insert

    from kvchat.app.store.column_types import utcnow
    from kvchat.app.store.database import create_engine
    from kvchat.app.store.tables import Message

    long = await store.create_conversation("alice")
    kept = await store.create_conversation("alice")
    kept_message = await store.add_message(kept.id, parent_id=None, role="user", content="x")
    now = utcnow()
    rows, parent = [], None
    for i in range(5000):
        rows.append(
            dict(
                id=f"msg_long{i:05d}",
                conversation_id=long.id,
                parent_id=parent,
                role="user" if i % 2 == 0 else "assistant",
                content=str(i),
                status="complete",
                created_at=now,
                updated_at=now,
            )
        )
        parent = rows[-1]["id"]
    engine = create_engine(store.url)
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(Message), rows)
    finally:
        await engine.dispose()
    await store.update_conversation("alice", long.id, current_leaf_id=parent)

    assert await store.delete_conversation("bob", long.id) is False  # not the owner's
    assert await store.delete_conversation("alice", long.id) is True
    assert await store.get_conversation("alice", long.id) is None
    assert await store.branch(long.id, parent) == []
    assert [m.id for m in await store.branch(kept.id, kept_message.id)] == [kept_message.id]
