"""The chat page and the operator view in headless Chromium (Debian's `chromium`, driven by
Playwright) against a started `kvchat serve`. Screenshots of both views go to
$KVCHAT_TEST_ARTIFACTS (default: <tmp>/kvchat-artifacts)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, WebSocketRoute, expect, sync_playwright

from kvchat_testing.service import Server

ARTIFACTS = Path(
    os.environ.get("KVCHAT_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "kvchat-artifacts")
)
# Waits go through locators and `expect` (Playwright's string predicates are eval'd in the
# page, which its Content-Security-Policy forbids, as it should).
expect.set_options(timeout=60_000)


def chromium_path() -> str:
    """Debian's chromium (the binary behind its /usr/bin/chromium wrapper script)."""
    for candidate in (
        "/usr/lib/chromium/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise RuntimeError("chromium is not installed (apt-get install chromium; .ci/run does)")


@pytest.fixture(scope="module")
def server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(dev_model, tmp_path_factory.mktemp("pages")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield browser
        browser.close()


@dataclass
class Tab:
    """A page, with what it reported: console errors (CSP violations among them), uncaught
    exceptions, dialogs (alert, confirm), all of which a test expects to stay empty."""

    page: Page
    server: Server
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def enter_key(self, path: str = "/") -> None:
        self.page.goto(self.server.url + path)
        self.page.fill("#key-input", self.server.key or "")
        self.page.click("#key-form button[type=submit]")
        self.page.wait_for_selector("#app:not([hidden])")

    def generation(self, max_tokens: int, temperature: float | None = None) -> None:
        """Set the composer's generation settings (in a collapsed section)."""
        if self.page.locator("#generation-settings").get_attribute("open") is None:
            self.page.click("#generation-settings summary")
        self.page.fill("#max-tokens", str(max_tokens))
        if temperature is not None:
            self.page.fill("#temperature", str(temperature))

    def last_assistant(self) -> Any:
        return self.page.locator(".message.assistant").last

    def screenshot(self, name: str, full_page: bool = False) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=full_page)
        return path


@pytest.fixture
def tab(browser: Browser, server: Server) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    tab = Tab(page, server)
    page.on("console", lambda m: tab.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: tab.errors.append(f"uncaught: {e}"))

    def dialog(d: Any) -> None:
        tab.dialogs.append(d.message)
        d.dismiss()

    page.on("dialog", dialog)
    yield tab
    context.close()
    assert not [e for e in tab.errors if "Content Security Policy" in e or "uncaught" in e], (
        tab.errors
    )
    assert tab.dialogs == []


def api(server: Server, method: str, path: str, body: Any = None) -> Any:
    r = httpx.request(method, server.url + path, json=body, headers=server.headers(), timeout=120)
    assert r.status_code < 400, r.text
    return r.json() if r.content else None


def stored_branch(server: Server, conv: str) -> list[dict[str, Any]]:
    return api(server, "GET", f"/v1/conversations/{conv}/messages")["data"]  # type: ignore[no-any-return]


def wait_until_longer(tab: Tab, than: int) -> int:
    body = tab.last_assistant().locator(".body")
    expect(body).to_have_text(re.compile(rf"^[\s\S]{{{than + 1},}}$"))
    return len(body.text_content() or "")


def test_chat_streams_stops_caches_edits_switches_branches_and_reloads(
    tab: Tab, server: Server
) -> None:
    page = tab.page
    tab.enter_key()
    page.click("#new-chat")
    tab.generation(2000, 1.0)
    page.fill("#input", "Tell me a long story about caches")
    page.press("#input", "Enter")

    # The conversation is created and the reply streams in, token by token.
    expect(page).to_have_url(re.compile(r".*#conv_\w+$"))
    conv = page.evaluate("location.hash.slice(1)")
    lengths = [0]
    while len(lengths) < 6:
        lengths.append(wait_until_longer(tab, lengths[-1]))
    assert lengths == sorted(set(lengths))  # grew at every step, never jumped back
    assert tab.last_assistant().get_attribute("data-status") == "generating"
    assert page.locator(f"#conversations li[data-id='{conv}']").count() == 1

    # Stop: the reply ends, marked stopped, and is stored as cancelled with what it had.
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-status='cancelled']")
    assert tab.last_assistant().locator(".mark").text_content() == "stopped"
    first_reply = stored_branch(server, conv)[-1]
    assert first_reply["status"] == "cancelled"
    assert 5 <= first_reply["usage"]["completion_tokens"] < 2000
    stats = tab.last_assistant().locator(".stats")
    assert (
        int(stats.get_attribute("data-completion-tokens") or 0)
        == first_reply["usage"]["completion_tokens"]
    )
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()

    # A second message: its prompt is served from the conversation's pinned KV.
    tab.generation(8)
    page.fill("#input", "And a **second** question")
    page.press("#input", "Enter")
    expect(page.locator(".message")).to_have_count(4)
    expect(tab.last_assistant()).to_have_attribute("data-status", "complete")
    stats = tab.last_assistant().locator(".stats")
    cached = int(stats.get_attribute("data-cached-tokens") or -1)
    second = stored_branch(server, conv)[-1]
    assert cached > 0
    assert cached == second["usage"]["cached_tokens"]
    assert float(stats.get_attribute("data-ttft-ms") or 0) == pytest.approx(
        second["timings"]["ttft_ms"]
    )
    assert "cached" in (stats.text_content() or "") and "tok/s" in (stats.text_content() or "")
    assert (
        page.locator(".message.user").nth(1).locator(".body").text_content()
        == "And a **second** question"
    )  # a user's message is text, not markdown

    # Edit the first message: a new branch; ‹ › switch between the two.
    first_user = page.locator(".message.user").first
    first_user.locator(".edit-button").click()
    page.fill(".edit-input", "An edited first message")
    page.click(".save-edit")
    expect(page.locator(".message")).to_have_count(2)
    expect(tab.last_assistant()).to_have_attribute("data-status", "complete")
    first_user = page.locator(".message.user").first
    assert first_user.locator(".position").text_content() == "2/2"
    assert first_user.locator(".body").text_content() == "An edited first message"
    first_user.locator(".prev").click()
    expect(page.locator(".message")).to_have_count(4)
    first_user = page.locator(".message.user").first
    assert first_user.locator(".position").text_content() == "1/2"
    assert first_user.locator(".body").text_content() == "Tell me a long story about caches"
    assert page.locator(".message.assistant").first.get_attribute("data-status") == "cancelled"
    tab.screenshot("chat.png")
    first_user.locator(".next").click()
    expect(page.locator(".message")).to_have_count(2)
    assert page.locator(".message.user").first.locator(".position").text_content() == "2/2"
    leaf = api(server, "GET", f"/v1/conversations/{conv}")["current_leaf_id"]
    assert leaf == stored_branch(server, conv)[-1]["id"]

    # Regenerate the reply: a second version of it, switchable the same way.
    before = tab.last_assistant().get_attribute("data-id")
    tab.last_assistant().locator(".regenerate").click()
    expect(tab.last_assistant().locator(".position")).to_have_text("2/2")
    expect(tab.last_assistant()).to_have_attribute("data-status", "complete")
    regenerated = stored_branch(server, conv)[-1]
    assert tab.last_assistant().get_attribute("data-id") == regenerated["id"] != before
    assert regenerated["siblings"] == [before, regenerated["id"]]

    # Rename it in the list.
    page.locator(f"#conversations li[data-id='{conv}'] .rename").click()
    page.fill(".rename-input", "Caches, renamed")
    page.press(".rename-input", "Enter")
    page.wait_for_selector(f"#conversations li[data-id='{conv}'] .open >> text=Caches, renamed")
    assert api(server, "GET", f"/v1/conversations/{conv}")["title"] == "Caches, renamed"
    assert page.locator("#chat-title").text_content() == "Caches, renamed"

    # Reload: the key is remembered, the conversation is listed and shown on its branch.
    page.reload()
    page.wait_for_selector(f"#conversations li[data-id='{conv}']")
    expect(page.locator(".message")).to_have_count(2)
    assert (
        page.locator(".message.user").first.locator(".body").text_content()
        == "An edited first message"
    )
    assert (
        page.locator(f"#conversations li[data-id='{conv}'] .open").text_content()
        == "Caches, renamed"
    )

    # The page put its key in the WebSocket's URL; the server's log has it redacted.
    # (Only the first-start announcement shows the key.)
    assert any("/ws?access_token=[redacted]" in line for line in server.output)
    assert server.key is not None
    assert [line for line in server.output if server.key in line] == [
        line for line in server.output if "created an admin API key" in line
    ]


def test_a_dropped_socket_reconnects_and_resumes_without_gaps(tab: Tab, server: Server) -> None:
    """The page's socket goes through a proxy in the test (Playwright's WebSocket routing),
    which drops it mid-reply; the page reconnects and resumes from the offset it had."""
    page = tab.page
    to_server: list[dict[str, Any]] = []
    to_page: list[tuple[int, dict[str, Any]]] = []  # (socket number, frame) the page got
    routes: list[WebSocketRoute] = []
    dropped: set[int] = set()

    def proxy(ws: WebSocketRoute) -> None:
        number = len(routes)
        routes.append(ws)
        upstream = ws.connect_to_server()

        def up(message: str | bytes) -> None:
            to_server.append(json.loads(message))
            upstream.send(message)

        def down(message: str | bytes) -> None:
            if number not in dropped:  # after the drop nothing reaches the page
                ws.send(message)
                to_page.append((number, json.loads(message)))

        ws.on_message(up)
        upstream.on_message(down)

    page.route_web_socket(re.compile(r".*/ws\?access_token=.*"), proxy)
    tab.enter_key()
    page.click("#new-chat")
    tab.generation(2000, 1.0)
    page.fill("#input", "A long answer, please")
    page.press("#input", "Enter")
    seen = wait_until_longer(tab, 0)
    seen = wait_until_longer(tab, seen)

    dropped.add(0)
    routes[0].close(code=4000, reason="network drop")  # both sides of the socket close
    page.wait_for_selector("#connection.reconnecting")
    page.wait_for_selector("#connection:not(.reconnecting)", state="attached")
    wait_until_longer(tab, wait_until_longer(tab, seen))
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-status='cancelled']")

    (resume,) = [f for f in to_server if f["type"] == "resume"]
    (start,) = [f for _, f in to_page if f["type"] == "start"]
    assert resume["message_id"] == start["message_id"] and len(routes) == 2
    # The deltas of the first socket end exactly where the resumed ones begin.
    first = [f for n, f in to_page if n == 0 and f["type"] == "delta"]
    second = [f for n, f in to_page if n == 1 and f["type"] == "delta"]
    assert resume["offset"] == first[-1]["offset"] + len(first[-1]["text"]) > 0
    assert second[0]["offset"] == resume["offset"]
    streamed = "".join(d["text"] for d in first + second)
    conv = page.evaluate("location.hash.slice(1)")
    assert stored_branch(server, conv)[-1]["content"] == streamed


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Until `condition()` holds; the bound only catches a hang, the wait is on the condition."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def test_typing_sends_typing_frames_that_bring_the_kv_back(tab: Tab, server: Server) -> None:
    """The page's socket goes through a proxy in the test. As its user writes, the page sends
    `typing` frames, at most one per 2 s; the first brings the conversation's KV, evicted to
    the host pool, back onto the device before any message is sent."""
    conv = api(server, "POST", "/v1/conversations", {"title": "typing"})["id"]
    api(server, "POST", f"/v1/conversations/{conv}/messages", {"content": "Hi", "max_tokens": 4})

    def engine() -> dict[str, Any]:
        return api(server, "GET", f"/v1/admin/sessions/{conv}")["engine"]  # type: ignore[no-any-return]

    wait_for(lambda: engine()["state"] == "resident", "the session's KV pinned")
    evicted = api(server, "POST", f"/v1/admin/sessions/{conv}/evict?offload=true")
    assert evicted["state"] == "offloaded" and engine()["tier"] == "host"

    page = tab.page
    typing: list[float] = []  # when each typing frame passed the proxy

    def proxy(ws: WebSocketRoute) -> None:
        upstream = ws.connect_to_server()

        def up(message: str | bytes) -> None:
            if json.loads(message)["type"] == "typing":
                typing.append(time.monotonic())
            upstream.send(message)

        ws.on_message(up)
        upstream.on_message(lambda message: ws.send(message))

    page.route_web_socket(re.compile(r".*/ws\?access_token=.*"), proxy)
    tab.enter_key(f"/#{conv}")
    expect(page.locator(".message")).to_have_count(2)
    # Keystrokes before the socket is open send nothing; the first one after it does.
    deadline = time.monotonic() + 120
    while not typing:
        assert time.monotonic() < deadline, "no typing frame"
        page.type("#input", "x")
    wait_for(lambda: engine()["tier"] == "device", "the KV back on the device")
    branch = stored_branch(server, conv)
    assert [m["role"] for m in branch] == ["user", "assistant"]  # the hint alone brought it

    # A burst of keystrokes sends at most one frame per 2 s of it, not one per key.
    before, start = len(typing), time.monotonic()
    page.type("#input", " and then a few more words")
    elapsed = time.monotonic() - start
    assert len(typing) - before <= 1 + elapsed / 2, (len(typing) - before, elapsed)


def test_conversation_list_pages_newest_first_and_deletes(tab: Tab, server: Server) -> None:
    made = [
        api(server, "POST", "/v1/conversations", {"title": f"paged {i}"})["id"] for i in range(21)
    ]
    page = tab.page
    page.goto(server.url)
    page.fill("#key-input", "kvc-not-a-key")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-error")).to_contain_text("Incorrect API key")
    assert page.locator("#app").is_hidden()
    tab.enter_key()
    expect(page.locator("#conversations li")).to_have_count(20)
    ids = page.eval_on_selector_all("#conversations li", "items => items.map(i => i.dataset.id)")
    assert ids[:20] == made[::-1][:20]  # newest first
    assert page.locator("#more-conversations").is_visible()
    page.click("#more-conversations")
    expect(page.locator(f"#conversations li[data-id='{made[0]}']")).to_have_count(1)
    ids = page.eval_on_selector_all("#conversations li", "items => items.map(i => i.dataset.id)")
    assert ids[20] == made[0]

    delete = page.locator(f"#conversations li[data-id='{made[0]}'] .delete")
    delete.click()
    assert delete.text_content() == "Delete?"  # asks first, in the page (no dialog)
    delete.click()
    page.wait_for_selector(f"#conversations li[data-id='{made[0]}']", state="detached")
    r = httpx.get(f"{server.url}/v1/conversations/{made[0]}", headers=server.headers())
    assert r.status_code == 404


def test_markup_in_a_reply_is_shown_as_text_and_runs_nothing(tab: Tab, server: Server) -> None:
    """The reply's text is put into the conversation through a real API path (useChat's
    endpoint stores a history it is given), since a random-weight model cannot be told what
    to write."""
    hostile = (
        '<script>window.__xss = 1; alert("script")</script>\n\n'
        '<img src="x" onerror="window.__xss = 2; alert(\'img\')">\n\n'
        "[a link](javascript:window.__xss=3) and **bold** text"
    )
    title = '<img src=x onerror="window.__xss = 4">'
    body = {
        "id": "xss-chat",
        "max_tokens": 2,
        "messages": [
            {"id": "u1", "role": "user", "parts": [{"type": "text", "text": title}]},
            {"id": "a1", "role": "assistant", "parts": [{"type": "text", "text": hostile}]},
            {"id": "u2", "role": "user", "parts": [{"type": "text", "text": "next"}]},
        ],
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/ui/chat", json=body, headers=server.headers(), timeout=120
    ) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in list(r.iter_lines())
    page_of = api(server, "GET", "/v1/conversations?limit=100")["data"]
    (conv,) = [c["id"] for c in page_of if c["metadata"].get("ui_chat_id") == "xss-chat"]
    assert stored_branch(server, conv)[1]["content"] == hostile

    page = tab.page
    tab.enter_key()
    page.goto(f"{server.url}/#{conv}")
    expect(page.locator(".message")).to_have_count(4)
    reply = page.locator(".message.assistant").first.locator(".body")
    text = reply.text_content() or ""
    assert '<script>window.__xss = 1; alert("script")</script>' in text
    assert '<img src="x" onerror="window.__xss = 2; alert(\'img\')">' in text
    assert reply.locator("strong").text_content() == "bold"  # markdown still renders
    assert page.locator("#messages script, #messages img, #messages [onerror]").count() == 0
    assert page.locator("a[href^='javascript']").count() == 0
    assert page.locator(".message.user").first.locator(".body").text_content() == title
    assert page.locator(f"#conversations li[data-id='{conv}'] .open").text_content() == title
    assert page.evaluate("window.__xss") is None
    assert tab.dialogs == []


def test_operator_view_shows_tunes_and_evicts_sessions(tab: Tab, server: Server) -> None:
    convs = []
    for words in (3, 40):
        conv = api(server, "POST", "/v1/conversations", {"title": f"{words} words"})["id"]
        for turn in range(2):
            api(
                server,
                "POST",
                f"/v1/conversations/{conv}/messages",
                {"content": " ".join(["word"] * words) + f" {turn}", "max_tokens": 4},
            )
        convs.append(conv)
    small, large = convs
    page = tab.page
    tab.enter_key("/admin")
    row = page.locator(f"#sessions tr[data-id='{small}']")
    row.wait_for()
    page.wait_for_selector(f"#sessions tr[data-id='{large}']")
    sessions = {s["conversation_id"]: s for s in api(server, "GET", "/v1/admin/memory")["sessions"]}
    assert row.get_attribute("data-state") == sessions[small]["state"] == "resident"
    # What the retention policy makes of it: where its KV is, who comes back, when, held.
    assert row.locator(".tier").text_content() == sessions[small]["tier"] == "device"
    assert row.locator(".class").text_content() == sessions[small]["class"] == "person"
    assert row.locator(".held").text_content() == ("held" if sessions[small]["held"] else "")
    wait = row.locator(".next-turn").text_content() or ""
    if sessions[small]["next_turn_s"] is None:  # more likely never than not
        assert wait == "never?"
    else:
        assert re.fullmatch(r"[\d.,]+ (s|min|h)", wait), wait
    assert (
        int((row.locator(".tokens").text_content() or "").replace(",", ""))
        == sessions[small]["tokens"]
    )
    assert page.locator("#gpu-bar .seg.pinned").get_attribute("data-blocks") not in (None, "0")

    # The live charts: a turn while the page watches shows up in TTFT and prefix hits.
    expect(page.locator("#now-kv")).to_have_text(re.compile(r"^now \d"))
    api(server, "POST", f"/v1/conversations/{large}/messages", {"content": "more", "max_tokens": 4})
    expect(page.locator("#now-ttft")).to_have_text(re.compile(r"^last \d[\d.,]* ms \(1 replies\)"))
    expect(page.locator("#now-hits")).to_have_text(re.compile(r"^last [1-9]"))  # > 0% reused

    # Sortable: by tokens, descending first, then ascending.
    page.click("#sessions th[data-key='tokens']")
    order = page.eval_on_selector_all("#sessions tbody tr", "rows => rows.map(r => r.dataset.id)")
    assert order.index(small) < order.index(large)  # ascending after the second click
    page.click("#sessions th[data-key='tokens']")
    order = page.eval_on_selector_all("#sessions tbody tr", "rows => rows.map(r => r.dataset.id)")
    assert order.index(large) < order.index(small)

    # A budget and a policy set on the page are what the admin API returns.
    row.locator(".edit").click()
    page.fill("#ed-max_kv_tokens", "4096")
    page.select_option("#ed-history_policy", "drop_oldest")
    page.click("#editor-save")
    page.wait_for_selector("#editor-message.saved")
    session = api(server, "GET", f"/v1/admin/sessions/{small}")
    assert session["settings"]["max_kv_tokens"] == 4096
    assert session["settings"]["history_policy"] == "drop_oldest"
    assert session["effective"]["max_kv_tokens"] == 4096
    expect(page.locator(f"#sessions tr[data-id='{small}'] .max-kv")).to_have_text("4,096")

    # A bad combination is refused with the API's message, and nothing changes.
    page.fill("#ed-high_watermark", "0.3")
    page.fill("#ed-low_watermark", "0.6")
    page.click("#editor-save")
    page.wait_for_selector("#editor-message.error")
    assert "low_watermark must not exceed high_watermark" in (
        page.locator("#editor-message").text_content() or ""
    )
    settings = api(server, "GET", f"/v1/admin/sessions/{small}")["settings"]
    assert settings["high_watermark"] is None and settings["max_kv_tokens"] == 4096

    # Evict: offload to the host pool, and the row's state changes.
    row.locator(".offload").click()
    page.wait_for_selector(f"#sessions tr[data-id='{small}'][data-state='offloaded']")
    assert page.locator(f"#sessions tr[data-id='{small}'] .tier").text_content() == "host"
    assert page.locator(f"#sessions tr[data-id='{small}'] .state").text_content() == "offloaded"
    sessions = {s["conversation_id"]: s for s in api(server, "GET", "/v1/admin/memory")["sessions"]}
    assert sessions[small]["state"] == "offloaded"
    expect(page.locator("#host-bar .seg.host")).not_to_have_attribute("data-blocks", "0")
    page.click("#editor-close")
    tab.screenshot("admin.png", full_page=True)


def test_pages_send_a_content_security_policy_and_no_inline_code(server: Server) -> None:
    for path in ("/", "/admin", "/static/chat.js", "/static/admin.js"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    for path in ("/", "/admin"):
        html = httpx.get(server.url + path).text
        scripts = re.findall(r"<script\b[^>]*>", html)
        assert scripts and all(" src=" in s for s in scripts)  # no inline script
        assert not re.search(r"\son\w+\s*=", html)  # no inline handlers
        assert not re.search(r"\sstyle\s*=", html) and "<style" not in html
