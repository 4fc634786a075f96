"""A session's settings — its token budgets, retention and history policy — declared once, here.

`SessionSettings` is what a request sets, what a conversation stores (the store's columns are
named by `SESSION_FIELDS`), and the server's defaults under them: `Settings` inherits these
fields, so each is also a KVCHAT_* variable and a flag of `kvchat serve`, and operators change
the defaults at run time with PUT /v1/admin/defaults. A field left None takes the value under
it: a conversation's from the server's defaults (`under`), the defaults' from HistoryPolicy's
(the retention fields' from the engine's retention policy, memory/retention.py). `policy()` and
`budget()` are the one place a HistoryPolicy and an engine SessionBudget are made from settings.

Token counts are at most INT32_MAX: the columns they are stored in are 32-bit."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from kvchat.app.ranges import INT32_MAX
from kvchat.history import MIN_TOOL_RESULT_TOKENS, POLICIES, HistoryPolicy, HistoryPolicyError

if TYPE_CHECKING:
    from kvchat.memory import SessionBudget

MAX_RETENTION_TTL_S = 7 * 86_400  # a week: a longer hold is a pin, not a retention hint

# HistoryPolicy's own defaults: what a field left None everywhere takes.
DEFAULT: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(HistoryPolicy)}


def _known_policy(value: str | None) -> str | None:
    if value is not None and value not in POLICIES:
        raise ValueError(f"must be one of {', '.join(POLICIES)}")
    return value


class SessionSettings(BaseModel):
    """A session's budget, retention and history policy (None: the value under it). Each field
    is checked alone here; `policy()` checks how they fit together (the watermarks' order)."""

    model_config = ConfigDict(extra="forbid")

    max_context_tokens: int | None = Field(
        None,
        ge=16,
        le=INT32_MAX,
        description="Prompt budget of a conversation (None: the model's context).",
    )
    max_kv_tokens: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Pinned-KV cap per session (None: no cap)."
    )
    history_policy: Annotated[str | None, AfterValidator(_known_policy)] = Field(
        None,
        description="What a conversation past its budget loses: "
        f"{', '.join(POLICIES)} (default {DEFAULT['policy']}).",
    )
    high_watermark: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Trim history once the prompt passes this fraction of its budget "
        f"(default {DEFAULT['high_watermark']}).",
    )
    low_watermark: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Trim down to this fraction; the gap keeps the prompt's prefix stable "
        f"(default {DEFAULT['low_watermark']}).",
    )
    max_tool_result_tokens: int | None = Field(
        None,
        ge=MIN_TOOL_RESULT_TOKENS,
        le=INT32_MAX,
        description="Tool results are cut to this many tokens in prompts (None: never cut).",
    )
    max_summary_tokens: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Length of a summary of dropped turns "
        f"(default {DEFAULT['max_summary_tokens']}).",
    )
    retention_ttl_s: float | None = Field(
        None,
        ge=0,
        le=MAX_RETENTION_TTL_S,
        description="Seconds a session's KV is held after each of its turns, at most 7 days "
        "(soft: under memory pressure a running request still takes its room; None: as the "
        "retention policy predicts).",
    )
    retention_priority: int | None = Field(
        None,
        ge=0,
        le=100,
        description="An operator's rank of a session's KV, 0-100: each 10 points above 50 "
        "doubles its worth to the retention policy, each 10 below halves it (None: 50).",
    )

    def policy(self) -> HistoryPolicy:
        """The history policy; a field left None takes HistoryPolicy's default. Raises
        HistoryPolicyError naming the field on a combination no turn can run."""
        return HistoryPolicy(
            policy=DEFAULT["policy"] if self.history_policy is None else self.history_policy,
            high_watermark=(
                DEFAULT["high_watermark"] if self.high_watermark is None else self.high_watermark
            ),
            low_watermark=DEFAULT["low_watermark"]
            if self.low_watermark is None
            else self.low_watermark,
            max_tool_result_tokens=self.max_tool_result_tokens,
            max_summary_tokens=(
                DEFAULT["max_summary_tokens"]
                if self.max_summary_tokens is None
                else self.max_summary_tokens
            ),
        )

    def context_budget(self, max_model_len: int) -> int:
        """The prompt budget: the session's, capped by the model's context."""
        if self.max_context_tokens is None:
            return max_model_len
        return min(self.max_context_tokens, max_model_len)

    def budget(self, max_model_len: int) -> SessionBudget:
        """The budget the engine holds the session's requests and pinned KV to."""
        from kvchat.memory import SessionBudget  # not at import: the store imports this module

        return SessionBudget(
            max_kv_tokens=self.max_kv_tokens,
            max_context_tokens=self.context_budget(max_model_len),
            retention_ttl_s=self.retention_ttl_s,
            retention_priority=self.retention_priority,
        )

    def under(self, overrides: Mapping[str, Any]) -> SessionSettings:
        """These settings (the defaults) under a stored conversation's own (`overrides`; None
        or absent: unset). Never raises, whatever a row holds: a value out of its field's
        range reads as unset, and own values whose policy does not fit together read as the
        defaults' policy (a turn refuses such a row first: check_session_settings)."""
        own = {
            n: v for n in SESSION_FIELDS if (v := overrides.get(n)) is not None and in_range(n, v)
        }
        merged = self.model_copy(update=own)
        try:
            merged.policy()
        except HistoryPolicyError:
            return merged.model_copy(update={n: getattr(self, n) for n in POLICY_FIELDS})
        return merged

    def filled(self) -> SessionSettings:
        """These settings with the history policy's defaults written in (what the server's
        defaults are shown as)."""
        p = self.policy()
        return self.model_copy(
            update={
                "history_policy": p.policy,
                "high_watermark": p.high_watermark,
                "low_watermark": p.low_watermark,
                "max_summary_tokens": p.max_summary_tokens,
            }
        )

    @classmethod
    def of(cls, source: object | Mapping[str, Any]) -> SessionSettings:
        """The session fields of `source`: the server's Settings, or a stored conversation's
        mapping of them."""
        if isinstance(source, Mapping):
            return cls.model_construct(**{n: source.get(n) for n in SESSION_FIELDS})
        return cls.model_construct(**{n: getattr(source, n) for n in SESSION_FIELDS})


SESSION_FIELDS: tuple[str, ...] = tuple(SessionSettings.model_fields)
# The engine's SessionBudget (kvchat.memory); the rest are the history policy's.
BUDGET_FIELDS = ("max_context_tokens", "max_kv_tokens", "retention_ttl_s", "retention_priority")
POLICY_FIELDS = tuple(n for n in SESSION_FIELDS if n not in BUDGET_FIELDS)


def in_range(name: str, value: Any) -> bool:
    """Whether `value` passes the rules of the SessionSettings field `name`, alone."""
    try:
        SessionSettings.model_validate({name: value})
    except ValidationError:
        return False
    return True
