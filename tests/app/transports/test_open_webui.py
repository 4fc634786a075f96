"""Open WebUI's own page chats with kvchat's default model (SmolLM2-135M-Instruct) through
`POST /v1/chat/completions`, as the README's Open WebUI section says it does.

A started `kvchat serve`, a recording proxy in front of it (every request Open WebUI sends and
the status it got), and `open-webui serve` offline with kvchat as its one OpenAI connection;
headless Chromium signs up Open WebUI's admin, picks the model and types two questions. Open
WebUI sends its 36 built-in tools with every typed message (and runs the calls it gets back,
asking again with their results); each question must end in a streamed text answer that the
page shows. After each reply it runs background tasks (follow-up suggestions; on the first
turn also the title and the tags) as more chat completions: each must get a 200 and a reply.

Open WebUI is installed from PyPI once per machine (kvchat_testing.open_webui: 2-3 min, 3 GB);
a warm run is kvchat's and Open WebUI's start plus the turns (~4 min on two cores). Its replies
and tasks get `max_tokens` and `temperature` 0 from Open WebUI's default model and task
parameters (Admin Settings), so the run stays short and its replies are greedy; without them it
sends no `max_tokens` for replies, follow-ups and tags, and no `temperature`.
$KVCHAT_TEST_ARTIFACTS (default <tmp>/kvchat-artifacts) gets the page's screenshot
(open-webui.png), every recorded request (open-webui-requests.json) and Open WebUI's log."""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from kvchat_testing import chromium
from kvchat_testing.open_webui import KVCHAT_ENV, OpenWebUI
from kvchat_testing.open_webui_page import OpenWebUIPage, Reply
from kvchat_testing.recording_proxy import Exchange, RecordingProxy, wait_for
from kvchat_testing.service import Server

# A cold run installs Open WebUI (2-3 min) and may build kvchat's CPU ops (~3 min) before the
# turns, each of which prefills Open WebUI's ~2,600-token tools prompt on a shared CPU.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ARTIFACTS = Path(
    os.environ.get("KVCHAT_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "kvchat-artifacts")
)
QUESTIONS = ("What is the capital of France?", "What is a famous museum there?")
MAX_REPLY_TOKENS = 96
MAX_TASK_TOKENS = 64
REPLY_TIMEOUT_S = 600.0
# Open WebUI's background tasks, by the first line of the prompt it sends for each.
TASK_PROMPTS = {
    "title": "### Task:\nGenerate a concise title",
    "tags": "### Task:\nGenerate 1-3 broad tags",
    "follow_ups": "### Task:\nPredict 3-5 useful messages",
}


def task_of(exchange: Exchange) -> str | None:
    """Which background task a chat completion is, None for a typed message's."""
    messages = (exchange.body or {}).get("messages") or [{}]
    content = messages[-1].get("content")
    for task, prompt in TASK_PROMPTS.items():
        if isinstance(content, str) and content.startswith(prompt):
            return task
    return None


@dataclass(frozen=True)
class Streamed:
    """A streamed chat completion's reply, its deltas joined."""

    content: str
    tool_calls: tuple[str, ...]  # "name(arguments)"
    finish_reason: str | None


def streamed(exchange: Exchange) -> Streamed:
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [name, arguments]
    finish_reason = None
    for line in exchange.response.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                name_args = calls.setdefault(call["index"], ["", ""])
                name_args[0] += call["function"].get("name") or ""
                name_args[1] += call["function"].get("arguments") or ""
            finish_reason = choice.get("finish_reason") or finish_reason
    return Streamed("".join(content), tuple(f"{n}({a})" for n, a in calls.values()), finish_reason)


def summary(exchanges: list[Exchange]) -> str:
    """What kvchat answered, a line per run of like answers: the message of a failed turn."""
    answers = []
    for exchange in exchanges:
        if exchange.status != 200:
            answers.append(f"{exchange.status} {exchange.error_message()}")
            continue
        reply = streamed(exchange)
        said = [repr(reply.content[:80])] if reply.content else []
        answers.append(f"200 {reply.finish_reason}: " + ", ".join(said + list(reply.tool_calls)))
    if not exchanges:
        return "no request"
    tools = [t["function"]["name"] for t in (exchanges[0].body or {}).get("tools") or []]
    runs = [f"{len(list(run))}x {answer}" for answer, run in itertools.groupby(answers)]
    return (
        f"{len(exchanges)} requests, each with {len(tools)} tools ({', '.join(tools)}):\n  "
        + "\n  ".join(runs)
    )


@pytest.fixture(scope="module")
def kvchat(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("kvchat")
    server = Server(smollm2_dir, data_dir, env=KVCHAT_ENV).start(timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(kvchat: Server) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(kvchat.url).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def open_webui(
    kvchat: Server, proxy: RecordingProxy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenWebUI]:
    assert kvchat.key is not None
    bounds = {
        "DEFAULT_MODEL_PARAMS": json.dumps({"max_tokens": MAX_REPLY_TOKENS, "temperature": 0}),
        "TASK_MODEL_PARAMS": json.dumps({"max_tokens": MAX_TASK_TOKENS, "temperature": 0}),
    }
    ui = OpenWebUI(f"{proxy.url}/v1", kvchat.key, tmp_path_factory.mktemp("open-webui"), bounds)
    try:
        yield ui.start()
    finally:
        ui.stop()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "open-webui.log").write_text("".join(ui.output))
        (ARTIFACTS / "open-webui-requests.json").write_text(
            json.dumps([asdict(e) for e in proxy.exchanges], indent=1)
        )


def test_open_webui_chats_with_the_default_model_and_its_tasks_are_answered(
    kvchat: Server, proxy: RecordingProxy, open_webui: OpenWebUI
) -> None:
    (model,) = [m["id"] for m in served_models(kvchat)]
    replies: list[Reply] = []
    answers: list[Streamed] = []
    with sync_playwright() as playwright:
        browser = chromium.launch(playwright)
        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        ui = OpenWebUIPage(page, open_webui.url)
        ui.sign_up("kvchat tests", "admin@kvchat.test", "kvchat-tests-password")
        ui.select_model(model)
        for question in QUESTIONS:
            asked = len(typed_requests(proxy))
            try:
                reply = ui.ask(question, timeout=REPLY_TIMEOUT_S)
            except AssertionError as e:
                answered = summary(typed_requests(proxy)[asked:])
                raise AssertionError(f"{e}; kvchat answered {answered}") from e
            # Its requests: one, or one per round of tool calls that Open WebUI ran.
            turn = typed_requests(proxy)[asked:]
            assert reply.error is None and turn and turn[-1].status == 200, (
                f"Open WebUI shows an error in place of the reply to {question!r}: "
                f"{reply.error!r}; kvchat answered " + summary(turn)
            )
            answer = streamed(turn[-1])
            assert answer.content.strip() and not answer.tool_calls, summary(turn)
            shown, written = set(words(reply.shown)), set(words(answer.content))
            assert len(written & shown) >= 0.8 * len(written), (reply, "shows", answer)
            replies.append(reply)
            answers.append(answer)

        # Each reply is followed by its follow-up suggestions, the first also by a title and
        # tags: chat completions without tools, answered in one JSON object (not streamed).
        expected = {"follow_ups": len(QUESTIONS), "title": 1, "tags": 1}
        wait_for(
            lambda: task_counts(proxy) == expected,
            timeout=REPLY_TIMEOUT_S,
            what=f"Open WebUI's background tasks {expected} (so far {task_counts(proxy)})",
        )
        ui.wait_until_idle(timeout=60)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "open-webui.png"))
        chat = ui.chat(replies[0].chat_id)
        browser.close()

    for exchange in typed_requests(proxy):  # what the test is about: tools, streamed
        assert exchange.body["stream"] is True and exchange.body["tools"], exchange.body
    tasks = [e for e in proxy.recorded("POST", "/v1/chat/completions") if task_of(e)]
    for exchange in tasks:
        assert exchange.status == 200, (task_of(exchange), exchange.response)
        assert exchange.body["stream"] is False and "tools" not in exchange.body
        (choice,) = exchange.response_json["choices"]
        assert choice["message"]["content"].strip(), (task_of(exchange), exchange.response)
    failed = [e for e in proxy.exchanges if e.status >= 400]
    assert not failed, failed
    # Open WebUI took the answers: a title (the model's, or the first question when the
    # model wrote no JSON), and the replies it stored end as kvchat streamed them (after
    # any rounds of tool calls it shows first).
    assert chat["title"] and chat["title"] != "New Chat"
    for reply, answer in zip(replies, answers):
        assert reply.content.strip().endswith(answer.content.strip()), (reply, answer)


def typed_requests(proxy: RecordingProxy) -> list[Exchange]:
    """The chat completions Open WebUI sent for typed messages, in order."""
    return [e for e in proxy.recorded("POST", "/v1/chat/completions") if task_of(e) is None]


def served_models(kvchat: Server) -> list[dict[str, str]]:
    r = httpx.get(f"{kvchat.url}/v1/models", headers=kvchat.headers(), timeout=30)
    r.raise_for_status()
    return r.json()["data"]  # type: ignore[no-any-return]


def task_counts(proxy: RecordingProxy) -> dict[str, int]:
    counts: dict[str, int] = {}
    for exchange in proxy.recorded("POST", "/v1/chat/completions"):
        task = task_of(exchange)
        if task is not None:
            counts[task] = counts.get(task, 0) + 1
    return counts


def words(text: str) -> list[str]:
    """The letters-only words of a text: markdown's list numbers and marks are not shown."""
    return re.findall(r"[^\W\d_]+", text)
