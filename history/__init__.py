"""History planning: which stored messages go into a turn's prompt under a token budget, the
running summary of what was dropped, and the policies operators choose. Pure Python over token
counts: imports no torch, no HTTP, no SQL (the service plans every turn with it cheaply).
See history/planner.py for the rules."""

from history.planner import (
    ContextLengthExceeded,
    ContextPlan,
    HistoryMessage,
    HistoryPolicy,
    HistoryPolicyError,
    InvalidHistoryError,
    MIN_TOOL_RESULT_TOKENS,
    POLICIES,
    ROLES,
    SUMMARY_INSTRUCTION,
    SUMMARY_SHARE,
    SummaryState,
    TOOL_CUT_MARKER,
    merge_summary,
    plan_context,
    summarization_messages,
    summary_max_new_tokens,
    tool_cap_split,
    units,
)

__all__ = [
    "MIN_TOOL_RESULT_TOKENS",
    "POLICIES",
    "ROLES",
    "SUMMARY_INSTRUCTION",
    "SUMMARY_SHARE",
    "TOOL_CUT_MARKER",
    "ContextLengthExceeded",
    "ContextPlan",
    "HistoryMessage",
    "HistoryPolicy",
    "HistoryPolicyError",
    "InvalidHistoryError",
    "SummaryState",
    "merge_summary",
    "plan_context",
    "summarization_messages",
    "summary_max_new_tokens",
    "tool_cap_split",
    "units",
]
