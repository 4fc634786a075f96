"""Messages as a tree: branches, siblings, the leaf, updates, crash recovery, summaries."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvchat.app.store import NEW_USER, MessageRecord, StaleFence, Store
from kvchat.app.store.column_types import utcnow

pytestmark = pytest.mark.anyio
TOOL_CALLS = [
    {
        "id": "call_0",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Zürich", "unit": "°C"}'},
    },
    {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
]


async def _say(
    store: Store,
    conversation_id: str,
    parent: MessageRecord | None,
    role: str,
    content: str,
    **fields: Any,
) -> MessageRecord:
    return await store.add_message(
        conversation_id,
        parent_id=None if parent is None else parent.id,
        role=role,
        content=content,
        **fields,
    )


async def _leaf(store: Store, conversation_id: str) -> str | None:
    conversation = await store.get_conversation("alice", conversation_id)
    assert conversation is not None
    return conversation.current_leaf_id


async def test_branch_children_and_the_moving_leaf(store: Store) -> None:
    c = (await store.create_conversation("alice")).id
    u1 = await _say(store, c, None, "user", "hello")
    a1 = await _say(store, c, u1, "assistant", "hi")
    u2 = await _say(store, c, a1, "user", "what is 2+2?")
    a2 = await _say(store, c, u2, "assistant", "4")
    assert await _leaf(store, c) == a2.id
    assert [m.id for m in await store.branch(c, a2.id)] == [u1.id, a1.id, u2.id, a2.id]

    # Edit u2: a sibling under a1; the leaf moves to it and on to its answer.
    u2b = await _say(store, c, a1, "user", "what is 3+3?")
    assert await _leaf(store, c) == u2b.id
    a2b = await _say(store, c, u2b, "assistant", "6")
    # Regenerate a2b without moving the leaf (e.g. a background candidate).
    a2c = await store.add_message(
        c, parent_id=u2b.id, role="assistant", content="six", move_leaf=False
    )
    assert await _leaf(store, c) == a2b.id

    assert [m.id for m in await store.branch(c, a2b.id)] == [u1.id, a1.id, u2b.id, a2b.id]
    assert [m.id for m in await store.branch(c, a2.id)] == [u1.id, a1.id, u2.id, a2.id]
    assert [m.id for m in await store.branch(c, u1.id)] == [u1.id]
    assert [m.id for m in await store.children(c, a1.id)] == [u2.id, u2b.id]
    assert [m.id for m in await store.children(c, u2b.id)] == [a2b.id, a2c.id]
    assert [m.id for m in await store.children(c, None)] == [u1.id]
    assert await store.children(c, a2.id) == []
    everything = await store.messages(c)
    assert [m.id for m in everything] == [u1.id, a1.id, u2.id, a2.id, u2b.id, a2b.id, a2c.id]
    assert [m.parent_id for m in everything] == [None, u1.id, a1.id, u2.id, a1.id, u2b.id, u2b.id]
    assert await store.branch(c, None) == []
    assert await store.branch(c, "msg_missing") == []

    # Switching the branch back is an update of the leaf.
    switched = await store.update_conversation("alice", c, current_leaf_id=a2.id)
    assert switched is not None and switched.current_leaf_id == a2.id

    # Another conversation's ids are not part of this one.
    d = (await store.create_conversation("alice")).id
    assert await store.branch(d, a2.id) == []
    assert await store.get_message(d, a2.id) is None
    assert await store.children(d, a1.id) == []
    assert await store.get_message(c, a2.id) == a2


async def test_a_deep_branch_comes_back_whole_and_in_order(store: Store) -> None:
    c = (await store.create_conversation("alice")).id
    parent: MessageRecord | None = None
    chain = []
    for i in range(60):
        parent = await _say(store, c, parent, "user" if i % 2 == 0 else "assistant", str(i))
        chain.append(parent.id)
    assert [m.id for m in await store.branch(c, chain[-1])] == chain
    assert [m.content for m in await store.branch(c, chain[30])] == [str(i) for i in range(31)]


async def test_add_message_checks_conversation_parent_role_status_and_fields(
    store: Store,
) -> None:
    c = (await store.create_conversation("alice")).id
    other = (await store.create_conversation("alice")).id
    foreign = await _say(store, other, None, "user", "elsewhere")
    with pytest.raises(ValueError, match="parent"):
        await _say(store, c, foreign, "user", "x")
    with pytest.raises(ValueError, match="parent"):
        await store.add_message(c, parent_id="msg_missing", role="user", content="x")
    with pytest.raises(LookupError):
        await store.add_message("conv_missing", parent_id=None, role="user", content="x")
    with pytest.raises(ValueError, match="role"):
        await store.add_message(c, parent_id=None, role="developer", content="x")
    with pytest.raises(ValueError, match="status"):
        await store.add_message(c, parent_id=None, role="user", content="x", status="done")
    with pytest.raises(TypeError, match="usage"):
        await store.add_message(c, parent_id=None, role="user", content="x", usage={})
    assert await store.messages(c) == []
    assert await _leaf(store, c) is None


async def test_json_and_text_fields_round_trip(store: Store) -> None:
    c = (await store.create_conversation("alice")).id
    rng = random.Random(7)
    token_ids = [0, 1, 151_642, 2**31 - 1, *(rng.randrange(200_000) for _ in range(3000))]
    u = await _say(store, c, None, "user", 'weather in Zürich? 🌦 \u2028 \\n "quoted"')
    a = await _say(
        store,
        c,
        u,
        "assistant",
        None,  # type: ignore[arg-type]
        tool_calls=TOOL_CALLS,
        token_ids=tuple(token_ids),
        num_tokens=3003,
        content_tokens=0,
        name="planner",
    )
    t = await _say(
        store,
        c,
        a,
        "tool",
        '{"temp": -3.5, "sky": "☁"}',
        tool_call_id="call_0",
        num_tokens=12,
        content_tokens=9,
    )
    nul = await _say(store, c, t, "assistant", "a\x00b")

    stored = {m.id: m for m in await store.messages(c)}
    assert stored[u.id].content == 'weather in Zürich? 🌦 \u2028 \\n "quoted"'
    assert stored[a.id].tool_calls == TOOL_CALLS and stored[a.id].content is None
    assert stored[a.id].token_ids == tuple(token_ids) and stored[a.id].name == "planner"
    assert (stored[a.id].num_tokens, stored[a.id].content_tokens) == (3003, 0)
    assert stored[t.id].tool_call_id == "call_0" and stored[t.id].role == "tool"
    assert stored[u.id].token_ids is None and stored[u.id].tool_calls is None
    # Postgres text cannot hold NUL; both backends store U+FFFD instead.
    assert stored[nul.id].content == "a\ufffdb" == nul.content
    assert stored == {m.id: m for m in (u, a, t, nul)} | {nul.id: stored[nul.id]}


async def test_update_message_finishes_a_generating_reply(store: Store) -> None:
    c = (await store.create_conversation("alice")).id
    u = await _say(store, c, None, "user", "count")
    a = await store.add_message(c, parent_id=u.id, role="assistant", status="generating")
    assert (a.status, a.content, a.token_ids) == ("generating", None, None)

    done = await store.update_message(
        a.id,
        status="complete",
        content="1 2 3",
        token_ids=[16, 220, 17, 220, 18],
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=5,
        cached_tokens=8,
        ttft_ms=12.5,
        total_ms=80.25,
        num_tokens=9,
        content_tokens=5,
    )
    assert (done.status, done.content) == ("complete", "1 2 3")
    assert done.token_ids == (16, 220, 17, 220, 18)
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (12, 5, 8)
    assert (done.ttft_ms, done.total_ms, done.finish_reason) == (12.5, 80.25, "stop")
    assert done.updated_at > a.updated_at and done.created_at == a.created_at
    assert await store.get_message(c, a.id) == done

    failed = await store.update_message(a.id, status="error", error="engine died")
    assert failed.error == "engine died" and failed.content == "1 2 3"
    with pytest.raises(LookupError):
        await store.update_message("msg_missing", status="complete")
    with pytest.raises(ValueError, match="status"):
        await store.update_message(a.id, status="finished")
    with pytest.raises(TypeError, match="parent_id"):
        await store.update_message(a.id, parent_id=None)


async def test_mark_interrupted_turns_every_generating_message_interrupted(
    store: Store,
) -> None:
    ids = []
    for owner in ("alice", "bob"):
        c = (await store.create_conversation(owner)).id
        u = await _say(store, c, None, "user", "q")
        ids.append(
            (
                c,
                (
                    await store.add_message(
                        c, parent_id=u.id, role="assistant", content="partial", status="generating"
                    )
                ).id,
            )
        )
        ids.append((c, u.id))
    marked = await store.mark_interrupted()
    assert sorted(m.id for m in marked) == sorted(m for _, m in ids[::2])
    assert [m.status for m in marked] == ["interrupted"] * 2
    assert await store.mark_interrupted() == []
    statuses = [(await store.get_message(c, m)) for c, m in ids]
    assert [m.status for m in statuses if m] == ["interrupted", "complete"] * 2
    assert [m.content for m in statuses if m] == ["partial", "q"] * 2
    # the conversation goes on from the interrupted reply
    c, interrupted = ids[0]
    nxt = await store.add_message(c, parent_id=interrupted, role="user", content="go on")
    assert [m.id for m in await store.branch(c, nxt.id)][-2:] == [interrupted, nxt.id]


async def test_latest_summary_is_the_newest(store: Store) -> None:
    c = (await store.create_conversation("alice")).id
    assert await store.latest_summary(c) is None
    first = await store.add_summary(c, text="they said hi", num_tokens=5, covers=["msg_a"])
    second = await store.add_summary(
        c, text="hi, then sums — ✓", num_tokens=9, covers=["msg_a", "msg_b", "msg_c"]
    )
    other = (await store.create_conversation("alice")).id
    await store.add_summary(other, text="other", num_tokens=1, covers=[])
    latest = await store.latest_summary(c)
    assert latest == second and latest.covers == ("msg_a", "msg_b", "msg_c")
    assert first.id != second.id and first.created_at <= second.created_at
    with pytest.raises(LookupError):
        await store.add_summary("conv_missing", text="x", num_tokens=1, covers=[])
    with pytest.raises(ValueError):
        await store.add_summary(c, text="x", num_tokens=-1, covers=[])


async def test_concurrent_writers_all_land(store: Store, run_sql: Callable[..., Any]) -> None:
    """A turn's writes race other turns' (SQLite: one writer at a time, waited for)."""
    conversations = [(await store.create_conversation("alice")).id for _ in range(3)]
    roots = [await _say(store, c, None, "user", "root") for c in conversations]

    async def turn(i: int) -> MessageRecord:
        c, root = conversations[i % 3], roots[i % 3]
        m = await store.add_message(c, parent_id=root.id, role="assistant", status="generating")
        await store.update_conversation("alice", c, trim_start_id=root.id)
        return await store.update_message(m.id, status="complete", content=str(i))

    done = await asyncio.gather(*(turn(i) for i in range(12)), store.mark_interrupted())
    replies = [m for m in done if isinstance(m, MessageRecord)]
    assert sorted(int(m.content or "") for m in replies) == list(range(12))
    counts = await run_sql(store.url, "SELECT count(*) AS n FROM messages")
    assert counts == [{"n": 15}]
    for c in conversations:
        assert len(await store.children(c, (await store.children(c, None))[0].id)) == 4


async def test_turn_context_and_start_reply_write_a_turn_in_one_go(store: Store) -> None:
    c = (await store.create_conversation("alice", system_prompt="be brief")).id
    assert await store.turn_context(c, None) == ([], None)
    u1 = await _say(store, c, None, "user", "hello")
    a1 = await _say(store, c, u1, "assistant", "hi")

    user, reply = await store.start_reply(
        c,
        parent_id=a1.id,
        user={"role": "user", "content": "more?", "num_tokens": 9},
        trim_start_id=NEW_USER,
    )
    assert user is not None and (user.parent_id, user.role, user.num_tokens) == (a1.id, "user", 9)
    assert (reply.parent_id, reply.role, reply.status, reply.content) == (
        user.id,
        "assistant",
        "generating",
        None,
    )
    conv = await store.get_conversation("alice", c)
    assert conv is not None and (conv.current_leaf_id, conv.trim_start_id) == (reply.id, user.id)
    assert [m.id for m in await store.messages(c)] == [u1.id, a1.id, user.id, reply.id]

    # A regeneration adds only the reply, under the given parent; the trim start is kept as
    # given (None clears it).
    none, again = await store.start_reply(c, parent_id=user.id, user=None, trim_start_id=u1.id)
    assert none is None and again.parent_id == user.id
    conv = await store.get_conversation("alice", c)
    assert conv is not None and (conv.current_leaf_id, conv.trim_start_id) == (again.id, u1.id)

    await store.add_summary(c, text="they said hello", num_tokens=4, covers=[u1.id, a1.id])
    branch, summary = await store.turn_context(c, again.id)
    assert [m.id for m in branch] == [u1.id, a1.id, user.id, again.id]
    assert summary is not None and summary.covers == (u1.id, a1.id)
    assert await store.turn_context(c, "msg_nope") == ([], summary)

    # Bad references change nothing.
    before = await store.messages(c)
    with pytest.raises(ValueError):
        await store.start_reply(c, parent_id="msg_nope", user=None, trim_start_id=None)
    with pytest.raises(ValueError):
        await store.start_reply(
            c, parent_id=a1.id, user={"role": "wizard", "content": "x"}, trim_start_id=None
        )
    with pytest.raises(ValueError):
        await store.start_reply(c, parent_id=a1.id, user=None, trim_start_id="msg_nope")
    with pytest.raises(LookupError):
        await store.start_reply("conv_nope", parent_id=None, user=None, trim_start_id=None)
    assert await store.messages(c) == before
    conv = await store.get_conversation("alice", c)
    assert conv is not None and conv.current_leaf_id == again.id


async def test_start_reply_is_fenced_and_takes_over_a_dead_turns_reply(store: Store) -> None:
    """A turn starts under its lock's fence, which must be above the conversation's last one;
    holding the lock, it marks a reply still `generating` (a dead turn's) interrupted."""
    c = (await store.create_conversation("alice")).id
    assert (await store.get_conversation("alice", c)).turn_fence == 0  # type: ignore[union-attr]
    user = {"role": "user", "content": "q"}
    _, dead = await store.start_reply(c, parent_id=None, user=user, trim_start_id=None, fence=5)
    conv = await store.get_conversation("alice", c)
    assert conv is not None and conv.turn_fence == 5
    with pytest.raises(StaleFence):  # an older lock's turn is refused
        await store.start_reply(c, parent_id=None, user=user, trim_start_id=None, fence=4)
    with pytest.raises(StaleFence):
        await store.start_reply(c, parent_id=None, user=user, trim_start_id=None, fence=5)
    assert len(await store.messages(c)) == 2  # nothing of the refused turns was written
    _, live = await store.start_reply(c, parent_id=None, user=user, trim_start_id=None, fence=9)
    assert (await store.get_message(c, dead.id)).status == "interrupted"  # type: ignore[union-attr]
    assert (await store.get_message(c, live.id)).status == "generating"  # type: ignore[union-attr]
    with pytest.raises(LookupError):
        await store.start_reply(
            "conv_gone", parent_id=None, user=user, trim_start_id=None, fence=10
        )


async def test_mark_interrupted_spares_conversations_another_process_generates(
    store: Store,
) -> None:
    ids = []
    for _ in range(2):
        c = (await store.create_conversation("alice")).id
        u = await _say(store, c, None, "user", "q")
        ids.append(
            (
                c,
                (
                    await store.add_message(
                        c, parent_id=u.id, role="assistant", status="generating"
                    )
                ).id,
            )
        )
    marked = await store.mark_interrupted(except_conversations={ids[1][0]})
    assert [m.id for m in marked] == [ids[0][1]]
    assert (await store.get_message(*ids[1])).status == "generating"  # type: ignore[union-attr]


async def test_mark_interrupted_spares_replies_begun_after_its_cutoff(store: Store) -> None:
    """A restarting process scans the live turn locks, then marks what is left: a turn another
    process began after the scan (its reply newer than the cutoff) keeps generating, and a
    reply completed meanwhile keeps its status (one conditional statement, not read then
    written)."""
    c = (await store.create_conversation("alice")).id
    u = await _say(store, c, None, "user", "q")
    dead = await store.add_message(c, parent_id=u.id, role="assistant", status="generating")
    done = await store.add_message(c, parent_id=u.id, role="assistant", status="generating")
    await store.update_message(done.id, status="complete", content="a whole reply")
    cutoff = utcnow()
    while utcnow() <= cutoff:  # the next reply is strictly newer, whatever the clock's step
        await asyncio.sleep(0)
    live = await store.add_message(c, parent_id=u.id, role="assistant", status="generating")
    marked = await store.mark_interrupted(created_before=cutoff)
    assert [(m.id, m.status) for m in marked] == [(dead.id, "interrupted")]
    after = {m.id: m.status for m in await store.messages(c)}
    assert after == {
        u.id: "complete",
        dead.id: "interrupted",
        done.id: "complete",
        live.id: "generating",
    }
    assert [m.id for m in await store.mark_interrupted()] == [live.id]
