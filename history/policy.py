"""History policies and budgets: what an operator chooses per session (policy, watermarks,
tool-result cap, summary length), the one place a turn's context and reply budgets are
resolved, and the summary's share of the budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvchat.history.errors import HistoryPolicyError

POLICIES = ("summarize", "drop", "drop_oldest", "none")
# The running summary's share of max_context_tokens, as placed (markup included): a quarter,
# as much as the default reply reserve (reply_budget). It stays well under the window, and
# beside a full summary and a default reserve half the window is left for the system prompt
# and the newest messages, whatever the budget.
SUMMARY_SHARE = 0.25
# The share of the context a reply reserves when the request names no max_tokens.
DEFAULT_REPLY_SHARE = 0.25
ROLES = ("user", "assistant", "tool")
# Smallest tool-result cap: room for the cut marker (about ten tokens in common tokenizers)
# plus a head and a tail worth reading.
MIN_TOOL_RESULT_TOKENS = 32


@dataclass(frozen=True)
class HistoryPolicy:
    """Per-session history settings. Watermarks are fractions of max_context_tokens
    (defaults after MemGPT: act at 0.75-0.8 of the window, cut back to about 0.5)."""

    policy: str = "drop"  # one of POLICIES
    high_watermark: float = 0.8
    low_watermark: float = 0.5
    max_tool_result_tokens: int | None = None  # None: tool results are never cut
    max_summary_tokens: int = 512

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise HistoryPolicyError(
                f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}", "policy"
            )
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise HistoryPolicyError(
                "watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1, got "
                f"{self.low_watermark} and {self.high_watermark}",
                "low_watermark" if self.low_watermark < 0.0 else "high_watermark",
            )
        cap = self.max_tool_result_tokens
        if cap is not None and cap < MIN_TOOL_RESULT_TOKENS:
            raise HistoryPolicyError(
                f"max_tool_result_tokens must be >= {MIN_TOOL_RESULT_TOKENS} or unset, got {cap}",
                "max_tool_result_tokens",
            )
        if self.max_summary_tokens < 1:
            raise HistoryPolicyError(
                f"max_summary_tokens must be >= 1, got {self.max_summary_tokens}",
                "max_summary_tokens",
            )

    def high_watermark_tokens(self, max_context_tokens: int) -> int:
        """need above this many tokens is a trim event (watermark policies)."""
        return _fraction_of(self.high_watermark, max_context_tokens)

    def low_watermark_tokens(self, max_context_tokens: int) -> int:
        """A trim event cuts need back to at most this many tokens when it can."""
        return _fraction_of(self.low_watermark, max_context_tokens)

    def summary_share_tokens(self, max_context_tokens: int) -> int:
        """The most tokens a running summary takes in the prompt, markup included: the
        SUMMARY_SHARE of the budget (max_summary_tokens bounds what is generated of it)."""
        return _fraction_of(SUMMARY_SHARE, max_context_tokens)


def context_budget(max_context_tokens: int | None, max_model_len: int) -> int:
    """A turn's prompt budget: the session's max_context_tokens (None: unset) within the
    model's context."""
    return min(max_model_len, max_context_tokens) if max_context_tokens else max_model_len


def reply_budget(requested: int | None, budget: int, default_max_tokens: int | None) -> int:
    """The tokens a turn reserves for its reply: what the request asks (max_tokens), else
    the default (the service's KVCHAT_DEFAULT_MAX_TOKENS) within DEFAULT_REPLY_SHARE of the
    budget, at least one."""
    if requested:
        return requested
    share = max(1, _fraction_of(DEFAULT_REPLY_SHARE, budget))
    return min(default_max_tokens, share) if default_max_tokens else share


def _fraction_of(fraction: float, limit: int) -> int:
    """floor(fraction x limit), rounded first so 0.29 x 100 gives 29, not 28."""
    return math.floor(round(fraction * limit, 6))
