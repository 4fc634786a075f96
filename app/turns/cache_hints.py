"""A client's hints of how long its prompt cache should live, as the engine takes them: a
retention for the request's session (memory.retention: the session's KV is held that many
seconds after each turn, softly; under pressure a hold is broken rather than a running request
stalled).

- OpenAI's `prompt_cache_retention` (Chat Completions, Responses): `in_memory` holds it 600 s
  (OpenAI keeps an in-memory cache 5-10 minutes of inactivity, at most an hour); `24h` holds it
  86,400 s (OpenAI offloads to storage: here the host pool and the KV store on disk hold it, and
  the engine keeps the session's token ids so it can load it back).
- Anthropic's `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a Chat Completions
  message's content parts (LiteLLM and OpenRouter send it in OpenAI-shaped requests): 300 s or
  3,600 s, 300 s without a ttl.

A request's hint is the longest of them. It reaches the engine in its session's budget
(`with_retention`), so it needs a session: an X-Session-Id, a `prompt_cache_key`
(app.turns.prompting.prompt_cache_session_key), a conversation or a keyless opening. A
request in none keeps no KV past its turn whatever it asks; the prefix cache serves it as
before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from kvchat.app.errors import invalid_request
from kvchat.app.schemas.chat import CacheControl, Message
from kvchat.memory import SessionBudget

PROMPT_CACHE_RETENTION_S = {"in_memory": 600.0, "24h": 86_400.0}
CACHE_CONTROL_TTL_S = {"5m": 300.0, "1h": 3_600.0}
DEFAULT_CACHE_CONTROL_TTL = "5m"  # Anthropic's, when a part gives none


def retention_ttl_s(
    prompt_cache_retention: str | None, messages: Sequence[Message] = ()
) -> float | None:
    """The request's hint: the longest of its `prompt_cache_retention` and its content parts'
    `cache_control` TTLs (None: it gives none). A bad `cache_control` is a 400 naming its path
    (`messages.0.content.1.cache_control.ttl`)."""
    hints = []
    if prompt_cache_retention is not None:
        hints.append(PROMPT_CACHE_RETENTION_S[prompt_cache_retention])
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.cache_control is not None:
                where = f"messages.{i}.content.{j}.cache_control"
                hints.append(cache_control_ttl_s(part.cache_control, where))
    return max(hints, default=None)


def cache_control_ttl_s(value: Any, param: str) -> float:
    """The seconds one part's `cache_control` asks for; a 400 naming `param` (or its field)
    when it is not Anthropic's shape."""
    try:
        control = CacheControl.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join([param, *(str(part) for part in first["loc"])])
        raise invalid_request(f"Invalid value for '{where}': {first['msg']}", where) from None
    return CACHE_CONTROL_TTL_S[control.ttl or DEFAULT_CACHE_CONTROL_TTL]


def with_retention(budget: SessionBudget, ttl_s: float) -> SessionBudget:
    """The session's budget with its retention the longer of its own and the hint's; the rest
    as it was (an operator's max_kv_tokens, max_context_tokens and priority are not lost). A
    stateless session's own retention is the longest hint it was given in this process (the
    engine holds its budget), a conversation's the one its settings give."""
    held = ttl_s if budget.retention_ttl_s is None else max(budget.retention_ttl_s, ttl_s)
    return replace(budget, retention_ttl_s=held)
