"""The service's database: API keys, conversations, message trees and summaries.

SQLAlchemy 2 async over SQLite (aiosqlite) or Postgres (asyncpg), one schema migrated by
Alembic (`migrations/`). Never imports torch or the engine.
"""

from kvchat.app.store.database import default_database_url, display_url
from kvchat.app.store.errors import (
    DatabaseUnreachable,
    InvalidDatabaseUrl,
    SchemaNotCurrent,
    StaleFence,
    StoreError,
)
from kvchat.app.store.message_store import NEW_USER
from kvchat.app.store.records import (
    OVERRIDE_FIELDS,
    ROLES,
    STATUSES,
    ConversationOverrides,
    ConversationRecord,
    ConversationUpdate,
    KeyRecord,
    MessageFields,
    MessageRecord,
    MessageUpdate,
    SummaryRecord,
)
from kvchat.app.store.schema import upgrade
from kvchat.app.store.store import Store

__all__ = [
    "NEW_USER",
    "OVERRIDE_FIELDS",
    "ROLES",
    "STATUSES",
    "ConversationOverrides",
    "ConversationRecord",
    "ConversationUpdate",
    "DatabaseUnreachable",
    "InvalidDatabaseUrl",
    "KeyRecord",
    "MessageFields",
    "MessageRecord",
    "MessageUpdate",
    "SchemaNotCurrent",
    "StaleFence",
    "Store",
    "StoreError",
    "SummaryRecord",
    "default_database_url",
    "display_url",
    "upgrade",
]
