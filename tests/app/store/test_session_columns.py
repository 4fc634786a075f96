"""A session's settings are declared once, by SessionSettings; the store spells them out for
the type checkers (the create/update TypedDict, ConversationRecord's fields, the conversations
table's columns) and the conversations API lists them in its responses (types only, no
ranges). Each of those holds the same names, in the same order, with the same types, each
nullable (None: the server's default)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, get_args, get_type_hints

from kvchat.app.schemas.conversations import StoredSessionSettings
from kvchat.app.session_settings import SESSION_FIELDS, SessionSettings
from kvchat.app.store import records, tables


def base_type(annotation: Any) -> type:
    """int | None -> int; Annotated[str | None, ...] -> str."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    args = [a for a in get_args(annotation) if a is not type(None)]
    assert len(args) == 1 and type(None) in get_args(annotation), annotation
    return args[0]  # type: ignore[no-any-return]


DECLARED = {
    name: base_type(get_type_hints(SessionSettings, include_extras=True)[name])
    for name in SESSION_FIELDS
}


def test_the_declaration_is_what_the_mirrors_are_checked_against() -> None:
    assert {
        "max_context_tokens": int,
        "max_kv_tokens": int,
        "history_policy": str,
        "high_watermark": float,
        "low_watermark": float,
        "max_tool_result_tokens": int,
        "max_summary_tokens": int,
        "retention_ttl_s": float,
        "retention_priority": int,
    } == DECLARED
    assert records.OVERRIDE_FIELDS == SESSION_FIELDS


def test_the_store_typeddict_matches() -> None:
    hints = get_type_hints(records.ConversationOverrides)
    assert tuple(hints) == SESSION_FIELDS
    assert {n: base_type(t) for n, t in hints.items()} == DECLARED


def test_the_record_matches() -> None:
    hints = get_type_hints(records.ConversationRecord)
    fields = [f.name for f in dataclasses.fields(records.ConversationRecord)]
    mirrored = [n for n in fields if n in DECLARED]
    assert tuple(mirrored) == SESSION_FIELDS
    assert {n: base_type(hints[n]) for n in mirrored} == DECLARED


def test_the_columns_match() -> None:
    columns = tables.Conversation.__table__.columns
    for name, kind in DECLARED.items():
        column = columns[name]
        assert column.nullable, name
        assert column.type.python_type is kind, (name, column.type)


def test_the_api_listing_matches() -> None:
    hints = get_type_hints(StoredSessionSettings)
    assert tuple(hints) == SESSION_FIELDS
    assert {n: base_type(t) for n, t in hints.items()} == DECLARED
