"""API keys: shown once, stored as a hash, authenticated, revoked."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvchat.app.store import KeyRecord, Store

pytestmark = pytest.mark.anyio
KEY_PATTERN = re.compile(r"^kvc-[A-Za-z0-9_-]{43}$")


async def test_create_returns_the_key_once_and_stores_only_its_hash(
    store: Store, run_sql: Callable[..., Any]
) -> None:
    record, key = await store.create_key("ci-agent", admin=True)
    assert KEY_PATTERN.match(key), key
    assert record.name == "ci-agent" and record.owner == "ci-agent" and record.is_admin
    assert record.key_prefix == key[:10] and record.is_active
    assert record.created_at.tzinfo is not None
    assert abs(datetime.now(UTC) - record.created_at) < timedelta(minutes=1)
    assert record.last_used_at is None and record.revoked_at is None

    rows = await run_sql(store.url, "SELECT * FROM api_keys")
    assert len(rows) == 1
    row = rows[0]
    assert row["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert all(key not in str(value) for value in row.values()), row
    # the key itself is nowhere else to be had
    assert key not in repr(record) and key not in repr(await store.list_keys())


async def test_keys_are_distinct_and_owner_defaults_to_the_name(store: Store) -> None:
    a, key_a = await store.create_key("a")
    b, key_b = await store.create_key("b", owner="team")
    assert key_a != key_b and a.id != b.id
    assert (a.owner, b.owner) == ("a", "team") and not a.is_admin
    assert [k.id for k in await store.list_keys()] == [a.id, b.id]
    with pytest.raises(ValueError):
        await store.create_key("  ")


async def test_authenticate_finds_the_key_and_records_use_at_most_once_a_minute(
    store: Store, run_sql: Callable[..., Any]
) -> None:
    record, key = await store.create_key("agent", owner="acme")
    assert await store.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert await store.authenticate("") is None

    first = await store.authenticate(key)
    assert isinstance(first, KeyRecord) and first.id == record.id and first.owner == "acme"
    assert first.last_used_at is not None
    [stored] = await store.list_keys()
    assert stored.last_used_at == first.last_used_at

    second = await store.authenticate(key)
    assert second is not None and second.last_used_at == first.last_used_at  # no write

    long_ago = datetime.now(UTC) - timedelta(minutes=5)
    await run_sql(store.url, "UPDATE api_keys SET last_used_at = :t", t=long_ago)
    third = await store.authenticate(key)
    assert third is not None and third.last_used_at is not None
    assert third.last_used_at > long_ago + timedelta(minutes=4)
    [stored] = await store.list_keys()
    assert stored.last_used_at == third.last_used_at


@pytest.mark.parametrize("by", ["id", "name", "prefix", "key"])
async def test_revoke_by_id_name_prefix_or_key_stops_authentication(store: Store, by: str) -> None:
    record, key = await store.create_key("doomed")
    other, other_key = await store.create_key("kept")
    ref = {"id": record.id, "name": "doomed", "prefix": record.key_prefix, "key": key}[by]

    revoked = await store.revoke_key(ref)
    assert revoked is not None and revoked.id == record.id and revoked.revoked_at is not None
    assert not revoked.is_active
    assert await store.authenticate(key) is None
    assert await store.authenticate(other_key) is not None
    assert await store.count_keys() == 1 and await store.count_keys(active_only=False) == 2

    again = await store.revoke_key(ref)  # idempotent: the first revocation time stays
    assert again is not None and again.revoked_at == revoked.revoked_at
    assert await store.revoke_key("no-such-key") is None
    listed = {k.id: k for k in await store.list_keys()}
    assert listed[record.id].revoked_at == revoked.revoked_at
    assert listed[other.id].revoked_at is None


async def test_revoke_refuses_a_name_shared_by_two_active_keys(store: Store) -> None:
    first, _ = await store.create_key("twin")
    second, _ = await store.create_key("twin")
    with pytest.raises(ValueError, match="2 active keys"):
        await store.revoke_key("twin")
    assert await store.count_keys() == 2
    assert (await store.revoke_key(first.key_prefix)) is not None
    revoked = await store.revoke_key("twin")  # now only one is active
    assert revoked is not None and revoked.id == second.id
    assert await store.count_keys() == 0
