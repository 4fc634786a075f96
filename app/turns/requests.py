"""An engine request from what a client asked, the same way for every transport (a
conversation's turn, Chat Completions, a stateless Responses call): first what the request
offers the model (`offer`: its tools, checked, their call format and the grammar the reply
must follow), then, once the prompt's ids are built, its sampling parameters checked by the
engine with the prompt (`prepare_request`). CPU-bound (schema compiles, checks): for a worker
thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvchat.app.runtime import Runtime
from kvchat.app.schemas.chat import SamplingFields
from kvchat.app.turns.cache_hints import with_retention
from kvchat.app.turns.prompting import offered_tools, sampling_params
from kvchat.app.turns.structured import content_schema, output_grammar
from kvchat.inference import (
    GENERIC,
    ChatMessage,
    CheckedRequest,
    Grammar,
    call_key,
    generic_answer_grammar,
)
from kvchat.memory import SessionBudget


@dataclass(frozen=True)
class Offer:
    """What a request offers the model: the tools rendered into its prompt (None: none), their
    names, the template's tool-call format, and the grammar the reply must follow."""

    tools: list[dict[str, Any]] | None
    tool_names: set[str] | None
    tool_format: str | None
    grammar: Grammar | None


def offer(runtime: Runtime, fields: SamplingFields) -> Offer:
    """Check the request's tools, tool_choice and response_format; compile its grammar."""
    tools = offered_tools(fields)
    names = {t.function.name for t in fields.tools} if fields.tools else None
    tool_format = runtime.template.tool_call_format if tools else None
    grammar = output_grammar(fields, tool_format, runtime.grammars)
    return Offer(tools, names, tool_format, grammar)


def prepare_request(
    runtime: Runtime,
    fields: SamplingFields,
    offered: Offer,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int | None,
    seed_offset: int = 0,
    session_id: str | None = None,
    budget: SessionBudget | None = None,
    retention_ttl_s: float | None = None,
) -> CheckedRequest:
    """The engine request: the prompt with the request's sampling, checked (a 400 naming the
    field now, not an error mid-stream). In a session it is held to the session's budget
    (`budget` when the caller owns it, sent with the request). `retention_ttl_s`, the client's
    hint (app.turns.cache_hints), goes into that budget, or into the one the engine holds for
    the session, and is sent with the request."""
    params = sampling_params(
        fields, max_tokens=max_tokens, seed_offset=seed_offset, grammar=offered.grammar
    )
    client = runtime.engine_client
    if session_id is not None and retention_ttl_s is not None:
        held = budget if budget is not None else client.session_budget(session_id)
        budget = with_retention(held, retention_ttl_s)
    return client.check(prompt_ids, params, session_id=session_id, budget=budget)


@dataclass(frozen=True)
class AnswerFallback:
    """What a turn in the generic tool format under tool_choice auto falls back to: the calls
    the conversation's last turn made (call_key; its results follow it), which count as made,
    and the request the turn runs instead when the model would only make those again, or is
    caught in a loop before its first call is whole: the same prompt, answered without a call.
    A small model under a tool-call grammar calls the same tool every round, so an agent loop
    that sends tools every turn (Open WebUI's page) would never end."""

    answered: frozenset[tuple[str, str]]
    answer: CheckedRequest


def answer_fallback(
    runtime: Runtime,
    fields: SamplingFields,
    offered: Offer,
    chat: Sequence[ChatMessage],
    request: CheckedRequest,
) -> AnswerFallback | None:
    """The fallback of a turn in the generic tool format under tool_choice auto; None for any
    other turn."""
    choice = fields.tool_choice
    if offered.tool_format != GENERIC or offered.tools is None or choice not in (None, "auto"):
        return None
    grammar = generic_answer_grammar(content_schema(fields, runtime.grammars))
    runtime.grammars.compile(grammar)
    answer = replace(request, params=replace(request.params, grammar=grammar))
    return AnswerFallback(frozenset(last_calls(chat)), answer)


def last_calls(chat: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """call_key of the calls of the assistant message the conversation's trailing tool
    results answer (none when it does not end with results)."""
    end = len(chat)
    while end and chat[end - 1].role == "tool":
        end -= 1
    if end == len(chat) or not end or chat[end - 1].role != "assistant":
        return []
    keys = []
    for call in chat[end - 1].tool_calls or ():
        function = call.get("function") or {}
        try:
            keys.append(call_key(str(function.get("name")), str(function.get("arguments"))))
        except (ValueError, RecursionError):
            continue
    return keys
