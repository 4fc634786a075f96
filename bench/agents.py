"""An OpenAI Agents SDK agent on `kvchat serve` of the default model (SmolLM2-135M-Instruct, whose
template has no tool format: kvchat's generic one): multi-step tool tasks, each run once through
Chat Completions (`OpenAIChatCompletionsModel`, the agent's requests carrying an `X-Session-Id`,
so they run in one session and each continues the previous step's pinned KV) and once through
the Responses API (`OpenAIResponsesModel`, chained by the SDK's `auto_previous_response_id`, so
the server keeps the history), the two interleaved task by task.

    python bench/agents.py [--max-turns 8] [--max-tokens 160] [--first-tool-choice required]

Four function tools (weather, local time, unit conversion, population lookup) answer from fixed
tables; six tasks need 2 to 6 calls, most of them independent (several calls in one step are
allowed: parallel_tool_calls is left unset, OpenAI's default), one chained (a call needs an
earlier result); bench/agent_tasks.py. Greedy (temperature 0), `--max-tokens` per step,
`--max-turns` steps per run; the first step's tool_choice is `--first-tool-choice`, and the
SDK sets it back to auto once a tool ran (its `reset_tool_choice`). Each API runs under a key
of its own owner, so the prefix cache (salted per owner) never serves one API's runs from the
other's; within an API the tasks share the system prompt and tools.

A run is completed when every required (tool, key argument) was called, judged from the calls
the tools executed, and the run ended with a final output (not max_turns, not an error). A call
is malformed when it names no offered function or its arguments are not a JSON object valid for
the tool's schema. Per step, from the wire (bench/agent_steps.py): prompt tokens, cached tokens
and prefilled = prompt - cached (the reply's usage); what the engine prefilled by its own count
(GET /v1/admin/memory's prefill_sources.computed, read before and after each request: the runs
are sequential); the step's new tokens: those of its prompt the conversation had not held
before, i.e. after the previous reply (the tool results, the generation prompt), by the
server's count (POST /v1/tokenize of the messages and tools the step's prompt renders: a Chat
Completions request's own, a Responses chain's items as kvchat stores them), so the prompt less
the previous prompt and the previous reply as this prompt holds it (a reply kvchat cut at a
repeated call is held shorter than its completion tokens count); beside it the old figure, the
prompt less the previous prompt and completion; the client's TTFT (request sent -> the first
generated event of the stream), latency and request bytes.

Goal: every step after the first prefills <= 1.1x its new tokens (the larger of the usage's and
the engine's count). Writes bench/results/agents.md and agents.png."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

import httpx
import httpx2
from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from agents.models.interface import Model
from openai import APIError, AsyncOpenAI

from kvchat.bench.agent_steps import (
    GOAL,
    Conversation,
    Counters,
    Recorder,
    Step,
    TokenCounts,
    conversation,
    cut_replies,
    held_reply,
    meets_goal,
    new_by_completion,
    new_tokens,
    ratio,
    token_counts,
)
from kvchat.bench.agent_tasks import (
    SCHEMAS,
    TASKS,
    TOOLS,
    AgentTask,
    Call,
    Requirement,
    ToolLog,
    judge,
    malformed,
    missing,
)
from kvchat.bench.common import (
    REPO,
    RESULTS,
    ensure_model,
    machine_header,
    markdown_table,
    stop_servers_on_sigterm,
)

CHAT = "chat completions"
RESPONSES = "responses"
APIS = (CHAT, RESPONSES)
PRESET = "smollm2-135m-instruct"
# What an agent's author would write: no example of kvchat's reply format (an example reply
# in its JSON made the model copy the example's two calls into every task).
INSTRUCTIONS = (
    "You are an agent. Call a tool for each thing the user asks for, several in one reply when "
    "they do not depend on each other; answer in text once every result is in."
)


# One run per API before the measured ones, not recorded: the first request compiles the
# grammars, and every API's tasks then find the system prompt and tools in the prefix cache.
WARM_UP = AgentTask(
    "warm_up",
    "What is the weather in Vienna?",
    "one call",
    1,
    (Requirement("get_weather", "city", ("vienna",)),),
)


@dataclass
class TaskRun:
    api: str
    task: AgentTask
    steps: list[Step]
    executed: list[Call]
    final_output: str | None
    end: str  # "final output", or the exception that ended the run

    @property
    def is_completed(self) -> bool:
        return judge(self.task, self.executed, self.final_output)

    @property
    def malformed(self) -> list[str]:
        found = (malformed(c.name, c.arguments, SCHEMAS) for s in self.steps for c in s.calls)
        return [reason for reason in found if reason is not None]


def make_agent(
    api: str, client: AsyncOpenAI, task: AgentTask, args: argparse.Namespace
) -> Agent[ToolLog]:
    model: Model
    if api == CHAT:
        model = OpenAIChatCompletionsModel(model=args.model.name, openai_client=client)
    else:
        model = OpenAIResponsesModel(model=args.model.name, openai_client=client)
    settings = ModelSettings(
        temperature=0,
        max_tokens=args.max_tokens,
        tool_choice=args.first_tool_choice,
        include_usage=True,  # the SDK asks for usage in a stream only from api.openai.com
        extra_headers={"X-Session-Id": f"agents-{task.name}"} if api == CHAT else None,
    )
    return Agent[ToolLog](
        name="assistant",
        instructions=INSTRUCTIONS,
        tools=list(TOOLS),
        model=model,
        model_settings=settings,
    )


Tokenize = Callable[[Conversation], Awaitable[TokenCounts]]


async def run_task(
    api: str,
    client: AsyncOpenAI,
    recorder: Recorder,
    tokenize: Tokenize,
    task: AgentTask,
    args: argparse.Namespace,
    dump: bool = True,
) -> TaskRun:
    log = ToolLog()
    first = len(recorder.exchanges)
    result = Runner.run_streamed(
        make_agent(api, client, task, args),
        task.prompt,
        context=log,
        max_turns=args.max_turns,
        auto_previous_response_id=api == RESPONSES,
    )
    final_output = None
    try:
        async for _ in result.stream_events():
            pass
        final_output = str(result.final_output)
        end = "final output"
    except (AgentsException, APIError) as e:
        end = type(e).__name__
    await recorder.settle()
    exchanges = recorder.exchanges[first:]
    if dump and args.dump is not None:
        with args.dump.open("a") as f:
            for i, x in enumerate(exchanges):
                record = {"api": api, "task": task.name, "request": i + 1, "status": x.status}
                f.write(json.dumps(record | {"body": x.body, "lines": x.lines}) + "\n")
    steps = []
    for i, exchange in enumerate(exchanges):  # counted once the run is over: untimed
        step = exchange.step()
        if step is not None:
            counts = await tokenize(conversation(exchanges[: i + 1]))
            steps.append(replace(step, tokenized=counts))
    return TaskRun(api, task, steps, log.executed, final_output, end)


async def run_all(
    base_url: str, keys: Mapping[str, str], admin_key: str, args: argparse.Namespace
) -> list[TaskRun]:
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
    ) as admin:

        async def counters() -> Counters:
            memory = (await admin.get("/v1/admin/memory")).raise_for_status().json()
            metrics = (await admin.get("/metrics")).raise_for_status().text
            return Counters(int(memory["prefill_sources"]["computed"]), *cut_replies(metrics))

        async def tokenize(rendered: Conversation) -> TokenCounts:
            """The server's count of a step's conversation, under its chat template and tools."""
            answer = await admin.post("/v1/tokenize", json=rendered.tokenize_request())
            return token_counts(rendered, answer.raise_for_status().json())

        recorder = Recorder(counters)
        clients = {
            api: AsyncOpenAI(
                base_url=f"{base_url}/v1",
                api_key=keys[api],
                max_retries=0,  # a retried request would be a step the tables do not show
                http_client=httpx2.AsyncClient(transport=recorder, timeout=600),
            )
            for api in APIS
        }
        for api in APIS:  # compiles the grammars, caches the system prompt and tools: unrecorded
            await run_task(api, clients[api], recorder, tokenize, WARM_UP, args, dump=False)
        runs = []
        for task in TASKS:
            for api in APIS:
                print(f"{task.name} on {api}", flush=True)
                runs.append(await run_task(api, clients[api], recorder, tokenize, task, args))
        for client in clients.values():
            await client.close()
        return runs


def create_key(data: Path, owner: str) -> str:
    """A key of its own owner (`kvchat keys create`): its own prefix cache."""
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kvchat.app.cli", "keys", "create"]
        + ["--name", owner, "--owner", owner],
        env={**os.environ, "KVCHAT_DATA_DIR": str(data)},
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return proc.stdout.strip()


# -- the report ------------------------------------------------------------------------------------


def calls_cell(step: Step) -> str:
    """The step's calls as `name(argument values)`, or "answer" when it made none."""
    if not step.calls:
        return "answer"
    return ", ".join(
        f"{c.name}({', '.join(map(str, json.loads(c.arguments).values()))})"
        if malformed(c.name, c.arguments, SCHEMAS) is None
        else f"{c.name} (malformed)"
        for c in step.calls
    )


def repeat_guard(counters: Counters | None) -> str:
    """What kvchat's repeat guard did to the step's reply: re-ran it as an answer (it would
    only have repeated the last step's calls), or cut it at a call it repeated."""
    if counters is None:
        return ""
    return ", ".join(
        what for what, n in (("answered", counters.answered), ("cut", counters.dropped)) if n
    )


def later_steps(runs: Sequence[TaskRun]) -> list[tuple[Step, Step, TaskRun, int]]:
    """Every step after a run's first: (previous, step, its run, its 1-based number)."""
    return [(r.steps[i - 1], r.steps[i], r, i + 1) for r in runs for i in range(1, len(r.steps))]


def step_rows(run: TaskRun) -> list[list[object]]:
    rows: list[list[object]] = []
    for i, step in enumerate(run.steps):
        previous = run.steps[i - 1] if i else None
        new = None if previous is None else new_tokens(step)
        counters = step.counters
        rows.append(
            [
                i + 1,
                calls_cell(step),
                step.prompt_tokens,
                step.cached_tokens,
                step.prefilled,
                "" if step.computed is None else step.computed,
                repeat_guard(counters),
                ""
                if previous is None
                else f"{previous.completion_tokens} / {held_reply(previous, step)}",
                "" if new is None else new,
                "" if new is None else f"{ratio(step.prefilled, new):.2f}",
                "" if new is None else f"{ratio(step.prefill_work, new):.2f}",
                "" if previous is None else ("yes" if meets_goal(step) else "**no**"),
                "" if previous is None else new_by_completion(previous, step),
                "" if step.ttft_ms is None else round(step.ttft_ms),
                "" if step.latency_ms is None else round(step.latency_ms),
                step.request_bytes,
            ]
        )
    return rows


STEP_HEADER = [
    "step",
    "calls (or answer)",
    "prompt",
    "cached",
    "prefilled (usage)",
    "engine computed",
    "repeat guard",
    "previous reply: completion / as held",
    "new",
    "usage / new",
    "max(usage, engine) / new",
    f"<= {GOAL}x",
    "prompt - previous prompt - completion",
    "TTFT ms",
    "latency ms",
    "request bytes",
]


def is_tokenized_as_prompt(step: Step) -> bool:
    """/v1/tokenize counted the step's conversation at its prompt tokens: it renders the
    messages and tools as the request did."""
    return step.tokenized is not None and step.tokenized.count == step.prompt_tokens


def summary_rows(runs: Sequence[TaskRun]) -> list[list[object]]:
    rows: list[list[object]] = []
    for api in APIS:
        mine = [r for r in runs if r.api == api]
        steps = [s for r in mine for s in r.steps]
        later = later_steps(mine)
        tokenized = f"{sum(map(is_tokenized_as_prompt, steps))}/{len(steps)}"
        if not later:
            completed = f"{sum(r.is_completed for r in mine)}/{len(mine)}"
            rows.append([api, completed, *[""] * 8, tokenized, "", ""])
            continue
        met = sum(meets_goal(s) for _, s, _, _ in later)
        worst = max(later, key=lambda x: ratio(x[1].prefill_work, new_tokens(x[1])))
        new = sum(new_tokens(s) for _, s, _, _ in later)
        usage = sum(s.prefilled for _, s, _, _ in later)
        work = sum(s.prefill_work for _, s, _, _ in later)
        by_completion = sum(new_by_completion(p, s) for p, s, _, _ in later)
        first_ttft = [t for r in mine if r.steps and (t := r.steps[0].ttft_ms) is not None]
        later_ttft = [t for _, s, _, _ in later if (t := s.ttft_ms) is not None]
        rows.append(
            [
                api,
                f"{sum(r.is_completed for r in mine)}/{len(mine)}",
                len(steps),
                sum(len(r.executed) for r in mine),
                sum(len(r.malformed) for r in mine),
                sum(s.prompt_tokens for s in steps),
                sum(s.prefill_work for s in steps),
                f"{met}/{len(later)}",
                f"{ratio(worst[1].prefill_work, new_tokens(worst[1])):.2f} "
                f"({worst[2].task.name}, step {worst[3]})",
                f"{usage} / {work} / {new} / {by_completion}",
                tokenized,
                round(statistics.median(first_ttft)) if first_ttft else "",
                round(statistics.median(later_ttft)) if later_ttft else "",
            ]
        )
    return rows


SUMMARY_HEADER = [
    "API",
    "completed",
    "steps",
    "calls executed",
    "malformed calls",
    "prompt tokens",
    "prefilled",
    f"later steps <= {GOAL}x new",
    "worst later step",
    "later steps: usage / engine / new / prompt - previous prompt - completion",
    "steps /v1/tokenize counts at their prompt",
    "TTFT p50 ms, step 1",
    "TTFT p50 ms, later",
]


def task_rows(runs: Sequence[TaskRun], api: str) -> list[list[object]]:
    return [
        [
            r.task.name,
            f"{r.task.num_calls} ({r.task.shape})",
            "yes" if r.is_completed else "no",
            len(r.steps),
            len(r.executed),
            len(r.malformed),
            r.end,
            sum(s.prompt_tokens for s in r.steps),
            sum(s.prefill_work for s in r.steps),
            ", ".join(map(str, missing(r.task, r.executed))) or "-",
        ]
        for r in runs
        if r.api == api
    ]


TASK_HEADER = [
    "task",
    "calls needed",
    "completed",
    "steps",
    "calls executed",
    "malformed",
    "ended by",
    "prompt tokens",
    "prefilled",
    "missing calls",
]


def tally(counts: Counter[int]) -> str:
    """`+2 on 10, -17 on 2`: each difference and on how many steps, the most usual first."""
    return ", ".join(f"{d:+d} on {n}" for d, n in counts.most_common())


def findings(runs: Sequence[TaskRun]) -> list[str]:
    """Every later step over the goal with its figures; then, over the later steps, how the
    previous reply as held compares with its completion tokens, what the usage prefilled
    beyond the new tokens, and how far it fell short of the engine's count; steps whose prompt
    /v1/tokenize counts otherwise."""
    out = []
    held_less_completion: Counter[int] = Counter()
    unmatched: Counter[int] = Counter()  # usage prefilled - new = held - cached -> steps
    under: Counter[int] = Counter()  # engine - usage -> steps
    answered = 0
    later = later_steps(runs)
    for previous, step, run, number in later:
        new, reply = new_tokens(step), held_reply(previous, step)
        held_less_completion[reply - previous.completion_tokens] += 1
        unmatched[step.prefilled - new] += 1
        if step.computed is not None and step.computed > step.prefilled:
            under[step.computed - step.prefilled] += 1
            answered += step.counters is not None and step.counters.answered > 0
        if meets_goal(step):
            continue
        line = (
            f"- over the goal ({ratio(step.prefill_work, new):.2f}x, "
            f"{step.prefill_work - new} tokens over new): {run.api}, {run.task.name} step "
            f"{number}: prompt {step.prompt_tokens} = previous prompt {previous.prompt_tokens} + "
            f"previous reply as held {reply} (its completion tokens: "
            f"{previous.completion_tokens}) + new {new}; usage: cached {step.cached_tokens}, "
            f"prefilled {step.prefilled}; engine computed {step.computed}"
        )
        if step.prefilled > new:
            line += (
                f"; the KV matched the held history but for its last {step.prefilled - new} tokens"
            )
        if previous.counters is not None and previous.counters.dropped > 0:
            line += "; the previous reply was cut at a call it repeated"
        out.append(line)
    if later:
        out.append(
            f"- the previous reply as held less its completion tokens, on the {len(later)} "
            f"later steps: {tally(held_less_completion)}"
        )
        out.append(
            "- prefilled (usage) less new, i.e. the held history's tokens the KV did not "
            f"match (prompt - new - cached): {tally(unmatched)}"
        )
    if under:
        out.append(
            f"- the usage's prefilled is under the engine's count on {under.total()} later "
            f"steps ({tally(under)}); kvchat re-ran {answered} of them as an answer"
        )
    for run in runs:
        for number, step in enumerate(run.steps, start=1):
            if not is_tokenized_as_prompt(step):
                count = None if step.tokenized is None else step.tokenized.count
                out.append(
                    f"- /v1/tokenize counted {count} tokens for {run.api}, {run.task.name} step "
                    f"{number}, whose prompt has {step.prompt_tokens}: its new tokens (the "
                    "tokenize's count after the previous reply) may render otherwise"
                )
    return out


def plot(runs: Sequence[TaskRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    top = 1
    for api, marker in zip(APIS, ("o", "x"), strict=True):
        later = later_steps([r for r in runs if r.api == api])
        xs = [new_tokens(s) for _, s, _, _ in later]
        engine = [s.computed or 0 for _, s, _, _ in later]
        usage = [s.prefilled for _, s, _, _ in later]
        ax.scatter(xs, engine, marker=marker, label=f"{api}: engine computed")
        ax.scatter(xs, usage, marker=marker, alpha=0.35, label=f"{api}: prefilled (usage)")
        top = max(top, *xs, *engine, *usage)
    ax.plot([0, top], [0, GOAL * top], "k--", linewidth=1, label=f"goal: {GOAL}x new")
    ax.set_xlabel(
        "new tokens in the step (after the previous reply: tool results + generation prompt)"
    )
    ax.set_ylabel("tokens prefilled")
    ax.set_title("Agents SDK steps after the first, SmolLM2-135M-Instruct")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


NOTES = (
    "Prefilled (usage) = prompt - cached tokens of the step's reply. Engine computed = what "
    "GET /v1/admin/memory's prefill_sources.computed grew by during the request (the runs are "
    "sequential). They differ where kvchat re-ran a reply as an answer (under auto, a reply "
    "that would only repeat the calls the last step made, or loop, before sending anything: "
    'kvchat:cut_tool_replies_total{outcome="answered_*"}): the first attempt prefilled the '
    "new tokens, the second reads the same prompt from the KV but computes its last token "
    "again, and the usage counts one attempt. New = the tokens of the step's prompt the "
    "conversation had not held before: those after the previous reply (the tool results, the "
    "generation prompt), by the server's own count: POST /v1/tokenize of the messages and tools "
    "the step's prompt renders (a Chat Completions request's own; for Responses, the chain's "
    "instructions as the system message and its input and output items as kvchat stores "
    "them), whose whole count is checked against the step's prompt tokens (the summary's "
    "steps /v1/tokenize counts at their prompt). Previous reply as held = prompt - previous "
    "prompt - new: the reply as this prompt holds it, its end of turn included (an uncut "
    "reply: its completion tokens, then `<|im_end|>` and a newline, which the KV does not hold, "
    "so the next step prefills them again); a reply kvchat cut at a call it repeated (or in a "
    "loop) is held closed where the repeat began, shorter than its completion tokens, which "
    "count the dropped ones. Prompt - previous prompt - "
    "completion is the figure new used to be: it counts the held reply's tokens past its "
    "completion as new, and after a cut reply falls short by the tokens dropped. Prefilled "
    "(usage) - new = the held history's tokens the KV did not match. A run's first step has no "
    "previous step; its cached tokens are the prefix cache's (the system prompt and tools, "
    "shared by one API's tasks and an unrecorded warm-up run before them). TTFT is the "
    "client's: request sent to the first generated event (a tool-call delta or item, or "
    "text); a re-run reply's includes its first attempt.\n"
)


def source_revision() -> str:
    def git(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    diff = git("diff", "HEAD", "--").stdout  # read only: the index is not refreshed
    if not diff:
        return head.stdout.strip()
    digest = hashlib.sha256(diff.encode()).hexdigest()[:12]
    return f"{head.stdout.strip()} with uncommitted changes (git diff HEAD sha256 {digest})"


def report(
    runs: Sequence[TaskRun], args: argparse.Namespace, load_start: tuple[float, float, float]
) -> str:
    header = machine_header(
        "An OpenAI Agents SDK agent on the default model (bench/agents.py)",
        {
            "model": f"{args.model.name} (kvchat's generic tool-call format)",
            "server": f"kvchat serve --model {args.model.name} (SQLite, its defaults) of "
            f"{source_revision()}; one run at a time; each API under its own key owner",
            "packages": ", ".join(
                f"{p} {version(p)}" for p in ("openai-agents", "openai", "kvchat", "torch")
            ),
            "agent": f"{len(TOOLS)} function tools ({', '.join(t.name for t in TOOLS)}), "
            f"temperature 0, max_tokens {args.max_tokens}, max_turns {args.max_turns}, "
            f"first step's tool_choice {args.first_tool_choice} (the SDK's reset_tool_choice "
            "makes it auto once a tool ran), parallel_tool_calls unset, streamed",
            "instructions": INSTRUCTIONS,
            CHAT: "OpenAIChatCompletionsModel, ModelSettings.extra_headers X-Session-Id "
            "agents-<task> (one session per run), the whole history resent each step",
            RESPONSES: "OpenAIResponsesModel, Runner.run_streamed(auto_previous_response_id="
            "True): each step sends previous_response_id and only its new items",
        },
        load_start=load_start,
    )
    parts = [header, "\n## Summary\n\n", markdown_table(SUMMARY_HEADER, summary_rows(runs))]
    parts.append(
        f"\nGoal: every step after the first prefills <= {GOAL}x its new tokens (by the larger "
        "of the usage's prefilled and the engine's count), new being the tokens of its prompt "
        "after the previous reply as /v1/tokenize counts them.\n"
    )
    for api in APIS:
        parts.append(f"\n## {api}\n\n")
        parts.append(markdown_table(TASK_HEADER, task_rows(runs, api)))
        for r in (r for r in runs if r.api == api):
            parts.append(f"\n### {api}: {r.task.name}\n\n> {r.task.prompt}\n\n")
            parts.append(markdown_table(STEP_HEADER, step_rows(r)))
            if r.final_output is not None:
                parts.append(f"\nFinal output: {json.dumps(r.final_output)[:300]}\n")
    found = findings(runs)
    parts.append(
        f"\n## Steps over {GOAL}x their new tokens, held replies, usage against the engine\n\n"
        + ("\n".join(found) if found else "None.")
        + "\n"
    )
    parts.append("\n" + NOTES)
    return "".join(parts)


def main() -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / PRESET)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--first-tool-choice", choices=("required", "auto"), default="required")
    parser.add_argument("--out", type=Path, default=RESULTS / "agents.md")
    parser.add_argument("--dump", type=Path, help="write every request and its reply (JSONL)")
    args = parser.parse_args()
    load_start = os.getloadavg()
    ensure_model(args.model, PRESET)
    set_tracing_disabled(True)  # the SDK's tracing exports to OpenAI
    from kvchat.bench.serve_rest import free_port
    from kvchat.bench.turn_overhead import start_server

    if args.dump is not None:
        args.dump.write_text("")
    with tempfile.TemporaryDirectory() as data:
        process, admin_key = start_server(args.model, Path(data), port := free_port())
        try:
            keys = {api: create_key(Path(data), f"agents-{api.split()[0]}") for api in APIS}
            runs = asyncio.run(run_all(f"http://127.0.0.1:{port}", keys, admin_key, args))
        finally:
            process.terminate()
            process.wait(60)
    text = report(runs, args, load_start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    plot(runs, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
