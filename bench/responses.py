"""An agent loop two ways against one `kvchat serve` (the dev model, SQLite): 10 tool-calling
steps through Chat Completions, resending the whole history every step (what agents do
today: no session header), and through the Responses API, sending only the new tool output
with `previous_response_id`. Every step forces one call (`tool_choice: "required"`, a bounded
schema), the client "runs" it and sends its output next step. Both loops run in the same
process against the same server, interleaved `--repeats` times, each loop with its own task
text (so neither reuses the other's blocks beyond the shared system prompt and tools).

Per step: prompt tokens (the reply's usage), tokens prefilled (prompt - cached: what the
engine computed; the total is checked against GET /v1/admin/memory's prefill_sources), the
minimum a step must prefill (its prompt minus the previous step's prompt and reply: what is
new), the client's TTFT (request sent -> first generated event of the stream) and the bytes
of the request body.

    python bench/responses.py [--steps 10] [--repeats 5] [--model models/dev]

Goals (issue 21): the Responses loop prefills <= 1.1x the minimum; its TTFT p50 at steps >= 5
is no worse than the resend loop's; its bytes per step stay flat while the resend loop's grow.
Writes bench/results/responses.md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from kvchat.bench.common import REPO, RESULTS, ensure_model, machine_header, markdown_table
from kvchat.bench.turn_overhead import start_server

SYSTEM = "You are a planning agent. Call the step tool for every step of the task."
SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["look", "move", "take", "drop", "wait"]},
        "target": {"type": "string", "enum": ["north", "south", "box", "key", "door"]},
    },
    "required": ["action", "target"],
    "additionalProperties": False,
}
DESCRIPTION = "Carry out one step of the task."
MAX_TOKENS = 64
LATE = 5  # steps from here on (1-based) are compared for TTFT


@dataclass
class Step:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    request_bytes: int
    first_event_ms: float  # to the stream's first event: the service's work before generating

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def sse_data(response: httpx.Response) -> Any:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


@dataclass(frozen=True)
class Streamed:
    events: list[Any]
    ttft_ms: float  # to the first event `first` accepts (the first generated one)
    first_event_ms: float  # to the first event at all (sent before generation starts)
    request_bytes: int


def post_stream(client: httpx.Client, path: str, body: dict[str, Any], first: Any) -> Streamed:
    raw = json.dumps(body).encode()
    started = time.perf_counter()
    ttft = first_event = None
    events = []
    with client.stream(
        "POST", path, content=raw, headers={"Content-Type": "application/json"}
    ) as response:
        response.raise_for_status()
        for event in sse_data(response):
            now = (time.perf_counter() - started) * 1e3
            first_event = now if first_event is None else first_event
            if ttft is None and first(event):
                ttft = now
            events.append(event)
    assert ttft is not None and first_event is not None, events[-1]
    return Streamed(events, ttft, first_event, len(raw))


def resend_loop(client: httpx.Client, task: str, steps: int, model: str) -> list[Step]:
    tools = [
        {
            "type": "function",
            "function": {"name": "step", "description": DESCRIPTION, "parameters": SCHEMA},
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task},
    ]
    out = []
    for _ in range(steps):
        body = {
            "model": model,
            "messages": messages,
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        streamed = post_stream(
            client,
            "/v1/chat/completions",
            body,
            lambda e: any(
                c["delta"].get("tool_calls") or c["delta"].get("content")
                for c in e.get("choices", [])
            ),
        )
        events = streamed.events
        calls: dict[int, dict[str, Any]] = {}
        for event in events:
            for choice in event["choices"]:
                for delta in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(
                        delta["index"], {"id": delta.get("id"), "name": "", "arguments": ""}
                    )
                    call["name"] += delta["function"].get("name") or ""
                    call["arguments"] += delta["function"].get("arguments") or ""
        usage = events[-1]["usage"]
        (call,) = calls.values()
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": tool_result(call["arguments"])}
        )
        out.append(
            Step(
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"],
                streamed.ttft_ms,
                streamed.request_bytes,
                streamed.first_event_ms,
            )
        )
    return out


def responses_loop(client: httpx.Client, task: str, steps: int, model: str) -> list[Step]:
    tools = [{"type": "function", "name": "step", "description": DESCRIPTION, "parameters": SCHEMA}]
    previous = None
    new_input: list[dict[str, Any]] = [{"role": "user", "content": task}]
    out = []
    for _ in range(steps):
        body = {
            "model": model,
            "input": new_input,
            "instructions": SYSTEM,
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "stream": True,
            **({"previous_response_id": previous} if previous else {}),
        }
        streamed = post_stream(
            client,
            "/v1/responses",
            body,
            lambda e: e["type"] in ("response.output_item.added", "response.output_text.delta"),
        )
        response = streamed.events[-1]["response"]
        assert response["status"] == "completed", response
        (call,) = [item for item in response["output"] if item["type"] == "function_call"]
        usage = response["usage"]
        previous = response["id"]
        new_input = [
            {
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": tool_result(call["arguments"]),
            }
        ]
        out.append(
            Step(
                usage["input_tokens"],
                usage["input_tokens_details"]["cached_tokens"],
                usage["output_tokens"],
                streamed.ttft_ms,
                streamed.request_bytes,
                streamed.first_event_ms,
            )
        )
    return out


def tool_result(arguments: str) -> str:
    args = json.loads(arguments)
    return f"You {args['action']} ({args['target']}). Nothing else happens."


def computed(client: httpx.Client) -> int:
    return int(client.get("/v1/admin/memory").json()["prefill_sources"]["computed"])


def minimum(steps: list[Step], i: int) -> int:
    """What step i (0-based, > 0) must prefill at least: its prompt less the previous prompt
    and reply. (The first step continues nothing: the prefix cache may hold its system
    prompt and tools from an earlier loop.)"""
    assert i > 0
    prev = steps[i - 1]
    return steps[i].prompt_tokens - prev.prompt_tokens - prev.completion_tokens


def median_of(runs: list[list[Step]], i: int, value: Any) -> float:
    return statistics.median(value(run, i) for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "dev")
    parser.add_argument("--out", type=Path, default=RESULTS / "responses.md")
    args = parser.parse_args()
    if args.steps < LATE + 1:
        parser.error(f"--steps must be at least {LATE + 1}")
    load_start = os.getloadavg()
    ensure_model(args.model, "dev")
    from kvchat.bench.serve_rest import free_port

    runs: dict[str, list[list[Step]]] = {"resend": [], "responses": []}
    counted: dict[str, int] = {"resend": 0, "responses": 0}
    with tempfile.TemporaryDirectory() as data:
        process, key = start_server(args.model, Path(data), port := free_port())
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}",
                timeout=300,
                headers={"Authorization": f"Bearer {key}"},
            ) as client:
                for repeat in tqdm(range(args.repeats), desc="repeats"):
                    for name, loop in (("resend", resend_loop), ("responses", responses_loop)):
                        before = computed(client)
                        task = (
                            f"Task {repeat}-{name}: get the key out of the box, then "
                            "open the door to the north."
                        )
                        runs[name].append(loop(client, task, args.steps, args.model.resolve().name))
                        counted[name] += computed(client) - before
        finally:
            process.terminate()
            process.wait(60)
    load_end = os.getloadavg()

    rows = []
    for i in range(args.steps):
        row: list[object] = [i + 1]
        for name in ("resend", "responses"):
            row += [
                int(median_of(runs[name], i, lambda r, j: r[j].prompt_tokens)),
                int(median_of(runs[name], i, lambda r, j: r[j].prefilled)),
                round(median_of(runs[name], i, lambda r, j: r[j].ttft_ms), 1),
                int(median_of(runs[name], i, lambda r, j: r[j].request_bytes)),
            ]
        row.insert(5, int(median_of(runs["responses"], i, minimum)) if i else "n/a")
        rows.append(row)
    totals: list[object] = ["total"]
    for name in ("resend", "responses"):
        totals += [
            sum(s.prompt_tokens for r in runs[name] for s in r) // args.repeats,
            sum(s.prefilled for r in runs[name] for s in r) // args.repeats,
            "",
            sum(s.request_bytes for r in runs[name] for s in r) // args.repeats,
        ]
    least = sum(minimum(r, i) for r in runs["responses"] for i in range(1, args.steps))
    totals.insert(5, f"{least // args.repeats} (steps 2-{args.steps})")
    rows.append(totals)
    table = markdown_table(
        [
            "step",
            "resend: prompt tokens",
            "resend: prefilled",
            "resend: TTFT p50 (ms)",
            "resend: request bytes",
            "responses: minimum to prefill",
            "responses: prompt tokens",
            "responses: prefilled",
            "responses: TTFT p50 (ms)",
            "responses: request bytes",
        ],
        rows,
    )

    later = range(1, args.steps)  # step 1 has nothing to continue
    ratio = sum(s.prefilled for r in runs["responses"] for s in (r[i] for i in later)) / max(
        1, sum(minimum(r, i) for r in runs["responses"] for i in later)
    )
    ttft = {
        name: statistics.median(s.ttft_ms for r in runs[name] for s in r[LATE - 1 :])
        for name in runs
    }
    first_event = {
        name: statistics.median(s.first_event_ms for r in runs[name] for s in r[LATE - 1 :])
        for name in runs
    }
    bytes_growth = {
        name: statistics.median(r[-1].request_bytes / r[1].request_bytes for r in runs[name])
        for name in runs
    }
    flat = bytes_growth["responses"] <= 1.1 < bytes_growth["resend"]
    goals = [
        f"- Responses prefilled / minimum over steps 2-{args.steps}: {ratio:.3f}x (goal <= "
        f"1.1x: {'met' if ratio <= 1.1 else 'not met'})",
        f"- TTFT p50 at steps >= {LATE}: Responses {ttft['responses']:.1f} ms, resend "
        f"{ttft['resend']:.1f} ms ({ttft['responses'] / ttft['resend']:.2f}x; goal <= 1x: "
        f"{'met' if ttft['responses'] <= ttft['resend'] else 'not met'}); of which before "
        f"generation starts (to the stream's first event): Responses "
        f"{first_event['responses']:.1f} ms, resend {first_event['resend']:.1f} ms",
        f"- request bytes, step {args.steps} / step 2: Responses "
        f"{bytes_growth['responses']:.2f}x, resend {bytes_growth['resend']:.2f}x (goal: flat "
        f"vs growing: {'met' if flat else 'not met'})",
        f"- prefilled tokens as the engine counted them (prefill_sources.computed, all "
        f"repeats): resend {counted['resend']}, Responses {counted['responses']}; as the "
        f"replies' usage says: resend "
        f"{sum(s.prefilled for r in runs['resend'] for s in r)}, Responses "
        f"{sum(s.prefilled for r in runs['responses'] for s in r)}",
    ]
    header = machine_header(
        "An agent loop: resending the history vs previous_response_id (bench/responses.py)",
        {
            "server": f"kvchat serve --model {args.model.name} (SQLite, in-process coordination)",
            "loop": f"{args.steps} steps, one forced tool call each (tool_choice required, "
            f"enum-bounded arguments, max {MAX_TOKENS} tokens, temperature 1), streamed; "
            f"{args.repeats} repeats of each loop, interleaved; per step the median",
            "resend": "POST /v1/chat/completions with the whole history, no X-Session-Id",
            "responses": "POST /v1/responses with previous_response_id and the tool output only",
        },
        load_start=load_start,
        load_end=load_end,
    )
    text = (
        header
        + "\n"
        + table
        + "\n"
        + "\n".join(goals)
        + "\n\n"
        + (
            "Prefilled = prompt tokens - cached tokens of the step's reply (cached: served from "
            "the session's pinned KV or the prefix cache). The minimum is what is new in a step's "
            "prompt: the tool output's segment and the generation prompt (its prompt less the "
            "previous step's prompt and reply). The resend loop still gets the prefix cache's "
            "full blocks up to where its re-rendered history first differs from what the model "
            "generated; the Responses loop continues the session's pinned tokens exactly. TTFT "
            "is the client's: request sent to the first generated event (a tool-call item or "
            "delta: the tool-call parser emits a call once its name is certain, some ten tokens "
            "into the reply, the same in both loops). The part before generation starts is the "
            "time to the stream's first event (sent when the reply starts): a Responses step "
            "reads the previous reply, the key, the conversation and its branch, plans it and "
            "commits the input and the reply's row before generating (the turn service's work "
            "for every stored turn), while a resend step stores nothing. The resend loop pays "
            "instead for the tokens the prefix cache's full blocks do not cover and a body that "
            "grows; that share grows with the model's cost per prefilled token (small on the "
            "dev model) and with the history, the stored turn's does not.\n"
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
