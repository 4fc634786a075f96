"""API keys: created here and shown once; only their sha256 is stored."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import replace
from datetime import timedelta

from sqlalchemy import func, or_, select, update

from kvchat.app.store.column_types import utcnow
from kvchat.app.store.queries import first_scalar
from kvchat.app.store.records import KeyRecord
from kvchat.app.store.store_base import StoreBase
from kvchat.app.store.tables import ApiKey

KEY_PREFIX = "kvc-"
KEY_PREFIX_CHARS = 10  # "kvc-" and 6 random characters, shown in listings
# authenticate() records use at most this often per key, so a busy key is not a write per call.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore(StoreBase):
    async def create_key(
        self, name: str, *, owner: str | None = None, admin: bool = False
    ) -> tuple[KeyRecord, str]:
        """A new key for owner (default: name). Returns the record and the key itself, which
        is not stored and cannot be shown again."""
        name = name.strip()
        owner = name if owner is None else owner.strip()
        if not name or not owner:
            raise ValueError("a key needs a non-empty name and owner")
        key = new_key()
        row = ApiKey(
            name=name,
            owner=owner,
            key_hash=hash_key(key),
            key_prefix=key[:KEY_PREFIX_CHARS],
            is_admin=admin,
        )
        async with self._write() as session:
            session.add(row)
            await session.flush()
            return KeyRecord.of(row), key

    async def authenticate(self, key: str) -> KeyRecord | None:
        """The active key's record, or None for an unknown or revoked key."""
        key_hash = hash_key(key)
        async with self._read() as session:
            row = await first_scalar(
                session,
                select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None)),
            )
            if row is None:
                return None
            record = KeyRecord.of(row)
        now = utcnow()
        if record.last_used_at is not None and now - record.last_used_at < LAST_USED_RESOLUTION:
            return record
        async with self._write() as session:
            await session.execute(
                update(ApiKey).where(ApiKey.id == record.id).values(last_used_at=now)
            )
        return replace(record, last_used_at=now)

    async def is_key_active(self, key_id: str) -> bool:
        """Whether the key exists and is not revoked (a cheap check by id, for connections
        that outlive one request)."""
        async with self._read() as session:
            row = (
                await session.execute(select(ApiKey.revoked_at).where(ApiKey.id == key_id))
            ).first()
            return row is not None and row[0] is None

    async def list_keys(self) -> list[KeyRecord]:
        async with self._read() as session:
            rows = await session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))
            return [KeyRecord.of(row) for row in rows]

    async def revoke_key(self, key_id_or_name_or_prefix: str) -> KeyRecord | None:
        """Revoke the key with this id, name, prefix (or the key itself). None if nothing
        matches; ValueError if several active keys do. Revoking a revoked key changes nothing."""
        ref = key_id_or_name_or_prefix.strip()
        async with self._write() as session:
            rows = list(
                await session.scalars(
                    select(ApiKey)
                    .where(
                        or_(
                            ApiKey.id == ref,
                            ApiKey.name == ref,
                            ApiKey.key_prefix == ref,
                            ApiKey.key_hash == hash_key(ref),
                        )
                    )
                    .order_by(ApiKey.created_at, ApiKey.id)
                )
            )
            active = [row for row in rows if row.revoked_at is None]
            if len(active) > 1:
                raise ValueError(
                    f"{ref!r} matches {len(active)} active keys "
                    f"({', '.join(row.key_prefix for row in active)}); give the prefix or id"
                )
            if not rows:
                return None
            row = active[0] if active else rows[-1]
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                await session.flush()
            return KeyRecord.of(row)

    async def count_keys(self, *, active_only: bool = True) -> int:
        query = select(func.count()).select_from(ApiKey)
        if active_only:
            query = query.where(ApiKey.revoked_at.is_(None))
        async with self._read() as session:
            return int(await first_scalar(session, query) or 0)
