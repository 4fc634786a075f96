"""An engine request from what a client asked, the same way for every transport (a
conversation's turn, Chat Completions, a stateless Responses call): first what the request
offers the model (`offer`: its tools, checked, their call format and the grammar the reply
must follow), then, once the prompt's ids are built, its sampling parameters checked by the
engine with the prompt (`prepare_request`). CPU-bound (schema compiles, checks): for a worker
thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.app.runtime import Runtime
from kvchat.app.schemas.chat import SamplingFields
from kvchat.app.turns.prompting import offered_tools, sampling_params
from kvchat.app.turns.structured import output_grammar
from kvchat.inference import CheckedRequest, Grammar
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
) -> CheckedRequest:
    """The engine request: the prompt with the request's sampling, checked (a 400 naming the
    field now, not an error mid-stream). In a session it is held to the session's budget
    (`budget` when the caller owns it, sent with the request)."""
    params = sampling_params(
        fields, max_tokens=max_tokens, seed_offset=seed_offset, grammar=offered.grammar
    )
    return runtime.engine_client.check(prompt_ids, params, session_id=session_id, budget=budget)
