"""Conversation: one chat kept in memory and run on a synchronous `Engine`, each turn planned
by the same step as the service's (inference.text.turn_planner: the history package's planner and
budgets, the context builder's prompt). What the service does with its database and the async
engine, for the command line, benchmarks and engine-level tests.

A turn: append the user (or tool-result) message, plan the prompt under the session's budget,
build its ids, run it in the conversation's session (so its KV stays pinned), store the reply
with the ids the model generated. When the plan drops messages under the `summarize` policy, a
summary of them is generated as background work (low priority) while turns go on; the turn
that dropped them uses the previous summary, a later turn gets the new one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kvchat.history import (
    ContextPlan,
    HistoryMessage,
    HistoryPolicy,
    SummaryState,
    context_budget,
    summary_targets,
)
from kvchat.memory.stats import HistoryStats

from ..engine.engine import Engine
from ..engine.priority import PRIORITY_LOW
from ..engine.request_output import RequestOutput
from ..errors import InvalidRequestError
from ..model.sampling_params import SamplingParams
from .chat_template import ChatMessage
from .context_builder import ContextBuilder, MessageCounts, history_message
from .turn_planner import branch_key, plan_turn

_ids = itertools.count()


@dataclass
class TurnResult:
    output: RequestOutput  # the final output of the assistant's reply
    plan: ContextPlan
    prompt_ids: list[int]
    summary_requested: bool


@dataclass
class _PendingSummary:
    request_id: str
    covers: tuple[str, ...]


@dataclass
class Conversation:
    engine: Engine
    builder: ContextBuilder
    session_id: str
    system: str | None = None
    policy: HistoryPolicy = field(default_factory=HistoryPolicy)
    cache_salt: str | None = None
    messages: dict[str, ChatMessage] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # the branch, oldest first
    counts: dict[str, MessageCounts] = field(default_factory=dict)
    start_id: str | None = None  # the trim point planned last turn
    summary: SummaryState | None = None
    pending_summary: _PendingSummary | None = None
    summaries: list[SummaryState] = field(default_factory=list)  # every summary made, in order
    summary_defects: list[str | None] = field(default_factory=list)  # why each was extracted
    summary_params: SamplingParams | None = None  # default: greedy, within the summary's share
    summarizer: str = "model"  # or "extractive": nothing generated (history.SUMMARIZERS)
    # What history planning did for this conversation (the service keeps these per session
    # in app.ops.history_counters; the engine counts none).
    history_stats: HistoryStats = field(default_factory=HistoryStats)

    # -- messages -------------------------------------------------------------------------------

    def append(self, message: ChatMessage) -> str:
        """Store a message and its token counts (measured once, in the conversation)."""
        message_id = f"m{next(_ids)}"
        self.messages[message_id] = message
        self.order.append(message_id)
        branch = [self.messages[i] for i in self.order]
        self.counts[message_id] = self.builder.count_last(
            self.system, branch, None, branch_key(self.session_id)
        )
        return message_id

    def history(self) -> list[HistoryMessage]:
        return [history_message(i, self.messages[i], self.counts[i]) for i in self.order]

    @property
    def max_context_tokens(self) -> int:
        budget = self.engine.sessions.budget(self.session_id).max_context_tokens
        return context_budget(budget, self.engine.max_model_len)

    # -- a turn ---------------------------------------------------------------------------------

    def submit(
        self, content: str, params: SamplingParams, role: str = "user"
    ) -> tuple[str, ContextPlan, list[int]]:
        """Append the message, plan the turn (the service's planning step), add the request
        (not run)."""
        self.append(ChatMessage(role, content))
        planned = plan_turn(
            self.builder,
            system=self.system,
            branch=[(i, self.messages[i], self.counts[i]) for i in self.order],
            new_message=None,
            tools=None,
            policy=self.policy,
            max_context_tokens=self.max_context_tokens,
            requested_max_tokens=params.max_tokens,
            default_max_tokens=None,
            summary=self.summary,
            start_id=self.start_id,
            generation_prompt_tokens=self.builder.generation_prompt_tokens(),
            conversation=self.session_id,
        )
        plan = planned.plan
        request_id = f"{self.session_id}-turn{next(_ids)}"
        self.engine.add_request(
            request_id,
            planned.prompt_ids,
            params,
            session_id=self.session_id,
            cache_salt=self.cache_salt,
        )
        self.start_id = plan.start_id
        self.history_stats.add(planned.history_stats)
        return request_id, plan, planned.prompt_ids

    def finish_turn(self, output: RequestOutput) -> None:
        """Store the reply with the ids the model generated (and count a turn that ran in sink
        + window mode)."""
        assert output.finished and output.output_token_ids is not None
        if output.window_applied:
            self.history_stats.add(HistoryStats(window_turns=1))
        self.append(ChatMessage("assistant", output.text, token_ids=tuple(output.output_token_ids)))

    def maybe_summarize(self, plan: ContextPlan) -> bool:
        """Start a background summary of what the plan dropped and no summary covers yet
        (history.summary_targets, as the service decides it)."""
        if self.pending_summary is not None:
            return False
        previous, newly = summary_targets(plan)
        if not newly or previous != self.summary:
            return False  # nothing new, or the summary grew since the plan was made
        # Within its share of the budget, so the summary fits beside the next turns.
        max_tokens = self.builder.summary_max_tokens(self.system, self.policy,
                                                     self.max_context_tokens)  # fmt: skip
        if max_tokens < 1:
            return False  # the budget leaves no room for a summary
        if self.summarizer == "extractive":
            self._settle(newly, None, cut_by_length=False, num_generated=0)
            return True
        text = previous.text if previous is not None else None
        prompt = self.builder.summarization_prompt(text, [self.messages[i] for i in newly])
        request_id = f"{self.session_id}-summary{next(_ids)}"
        params = self.summary_params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
        try:
            self.engine.add_request(
                request_id, prompt, params, cache_salt=self.cache_salt, priority=PRIORITY_LOW
            )
        except InvalidRequestError:  # the dropped text alone overflows the model: no summary
            return False
        self.pending_summary = _PendingSummary(request_id, newly)
        return True

    def on_output(self, output: RequestOutput) -> bool:
        """Take a finished summary's output; returns whether the output was ours."""
        pending = self.pending_summary
        if pending is None or output.request_id != pending.request_id:
            return False
        if output.finished:
            self.pending_summary = None
            if output.finish_reason in ("stop", "length") and output.text is not None:
                self._settle(pending.covers, output.text, output.finish_reason == "length",
                             output.num_output_tokens)  # fmt: skip
        return True

    def _settle(
        self, newly: tuple[str, ...], text: str | None, cut_by_length: bool, num_generated: int
    ) -> None:
        """Replace the running summary (history.summaries: the generated text if it keeps what
        it covers, else the extract)."""
        share = self.policy.summary_share_tokens(self.max_context_tokens)
        settled = self.builder.settle_summary(self.system, self.summary,
                                              [(i, self.messages[i]) for i in newly],
                                              text, cut_by_length, share,
                                              [(i, self.messages[i]) for i in self.summary.covers]
                                              if self.summary is not None else None)  # fmt: skip
        if settled is None:
            return  # not one more message fits the summary's share
        self.summary = settled.state
        self.summaries.append(self.summary)
        self.summary_defects.append(settled.defect)
        self.history_stats.add(
            HistoryStats(
                summaries=1,
                summary_tokens=num_generated,
                summaries_extracted=int(settled.extracted),
            )
        )

    def turn(
        self,
        content: str,
        params: SamplingParams,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> TurnResult:
        """Run one turn to its end on the engine (stepping it; other requests progress too)."""
        request_id, plan, prompt = self.submit(content, params)
        final = None
        while final is None:
            outputs = self.engine.step()
            if on_step is not None:
                on_step(outputs)
            for out in outputs:
                if out.request_id == request_id and out.finished:
                    final = out
                else:
                    self.on_output(out)
        self.finish_turn(final)
        requested = self.policy.policy == "summarize" and self.maybe_summarize(plan)
        return TurnResult(final, plan, prompt, requested)
