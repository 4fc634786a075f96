"""What history planning raises: each names the field (or is OpenAI's context error)."""

from __future__ import annotations


class HistoryPolicyError(ValueError):
    """A history setting is out of range; `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class InvalidHistoryError(ValueError):
    """Messages or planning arguments that break the rules (orphan tool result, negative
    count, ...); `field` names the argument."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(ValueError):
    """Even the smallest allowed prompt does not fit; states both numbers, as OpenAI does.

    num_tokens: the prompt's tokens plus the max_tokens reserve; limit: max_context_tokens.
    """

    code = "context_length_exceeded"
    param = "messages"

    def __init__(self, num_tokens: int, limit: int, max_tokens: int = 0) -> None:
        self.num_tokens, self.limit, self.max_tokens = num_tokens, limit, max_tokens
        head = f"This model's maximum context length is {limit} tokens. However, "
        if max_tokens > 0:
            tail = (
                f"you requested {num_tokens} tokens ({num_tokens - max_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        else:
            tail = (
                f"your messages resulted in {num_tokens} tokens. Please reduce the length "
                "of the messages."
            )
        super().__init__(head + tail)

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:
        return (type(self), (self.num_tokens, self.limit, self.max_tokens))
