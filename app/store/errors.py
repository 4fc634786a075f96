"""What the store raises at the edges a user can reach: one line each, no traceback needed."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

# What failing to connect looks like: refused or unknown hosts, drivers' errors, timeouts.
CONNECT_ERRORS = (OSError, SQLAlchemyError, TimeoutError)


class StoreError(Exception):
    """The database cannot be used as configured; str() is one line saying what to do."""


class InvalidDatabaseUrl(StoreError):
    """The database URL does not parse or names a database kvchat does not support."""


class DatabaseUnreachable(StoreError):
    """Connecting to the database failed (refused, unknown host or database, bad password)."""


class SchemaNotCurrent(StoreError):
    """The database's schema is missing or not at the migrations' head."""


class StaleFence(Exception):
    """A turn's lock was taken over by a newer one (its fence is not above the conversation's
    last): the turn must not start."""


def unreachable(where: str, error: BaseException) -> DatabaseUnreachable:
    """DatabaseUnreachable for one of CONNECT_ERRORS, with the driver's own first line."""
    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    lines = str(cause).strip().splitlines()
    reason = lines[0] if lines else type(cause).__name__
    return DatabaseUnreachable(f"cannot use the database at {where}: {reason}")
