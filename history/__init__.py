"""History planning: which stored messages go into a turn's prompt under a token budget, the
running summary of what was dropped, and the policies operators choose. Pure Python over token
counts: imports no torch, no HTTP, no SQL (the service plans every turn with it cheaply).

- history.planner: plan_context and its rules (watermarks, units, tool-result caps);
- history.policy: HistoryPolicy, and the one place context and reply budgets are resolved;
- history.summaries: the running summary, its prompt, its share, what a new one folds in,
  the checks a generated one passes and the extract that replaces one that fails;
- history.errors: what planning raises, each naming the field.
"""

from kvchat.history.errors import ContextLengthExceeded, HistoryPolicyError, InvalidHistoryError
from kvchat.history.planner import (
    TOOL_CUT_MARKER,
    ContextPlan,
    HistoryMessage,
    plan_context,
    tool_cap_split,
    units,
)
from kvchat.history.policy import (
    DEFAULT_REPLY_SHARE,
    MIN_TOOL_RESULT_TOKENS,
    POLICIES,
    ROLES,
    SUMMARY_SHARE,
    HistoryPolicy,
    context_budget,
    reply_budget,
)
from kvchat.history.summaries import (
    SUMMARIZERS,
    SUMMARY_INSTRUCTION,
    SummaryState,
    end_at_sentence,
    extract_lines,
    facts,
    merge_summary,
    missing_facts,
    sentences,
    stated_facts,
    summarization_messages,
    summary_defect,
    summary_max_new_tokens,
    summary_targets,
    with_period,
)

__all__ = [
    "DEFAULT_REPLY_SHARE",
    "MIN_TOOL_RESULT_TOKENS",
    "POLICIES",
    "ROLES",
    "SUMMARIZERS",
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
    "context_budget",
    "end_at_sentence",
    "extract_lines",
    "facts",
    "merge_summary",
    "missing_facts",
    "plan_context",
    "reply_budget",
    "sentences",
    "stated_facts",
    "summarization_messages",
    "summary_defect",
    "summary_max_new_tokens",
    "summary_targets",
    "tool_cap_split",
    "units",
    "with_period",
]
