"""The ranges of the integers requests carry, in one place: token counts and budgets fit the
32-bit INTEGER columns they are stored in (Postgres's `integer`), seeds are 64-bit signed as
in OpenAI's and torch's generators. A value outside its range is a 400 naming the field
(pydantic's `ge`/`le`, shown as `minimum`/`maximum` in the OpenAPI schema), never a 500 from
a database or the engine."""

from __future__ import annotations

INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def wrap_int64(value: int) -> int:
    """`value` wrapped into int64 (two's complement): INT64_MAX + 1 is INT64_MIN."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN
