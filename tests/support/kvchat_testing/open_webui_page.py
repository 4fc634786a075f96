"""Open WebUI's own page, driven by Playwright as a person uses it: the first (admin) account
signed up on its form, a model picked in its selector, questions typed into its composer.

What a reply is comes from Open WebUI's own record of the chat (its REST API, with the page's
token): whether the turn is done, its text, and the error its page shows in place of a reply
when the upstream request failed. The page is checked to show the same."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, expect

CHAT_URL = re.compile(r".*/c/([0-9a-f-]+)$")  # a plain group: expect() runs it in JS


@dataclass(frozen=True)
class Reply:
    """An assistant turn as Open WebUI stored and shows it."""

    chat_id: str
    message_id: str
    content: str
    error: str | None  # the error bubble's text, when Open WebUI got no reply
    shown: str  # the text of the message on the page


def _error_text(error: Any) -> str | None:
    if not error:
        return None
    if isinstance(error, dict):
        return str(error.get("content") or error.get("message") or error)
    return str(error)


def _text(message: dict[str, Any]) -> str:
    """A message's text: `content`, else the text parts of its `output` items."""
    if message.get("content"):
        return str(message["content"])
    return "".join(
        part.get("text", "")
        for item in message.get("output") or []
        for part in item.get("content") or []
        if isinstance(part, dict)
    )


@dataclass
class OpenWebUIPage:
    page: Page
    url: str  # Open WebUI's, e.g. http://127.0.0.1:8080

    def sign_up(self, name: str, email: str, password: str) -> None:
        """The first account of a fresh Open WebUI, which is its admin."""
        page = self.page
        page.goto(f"{self.url}/auth")
        page.get_by_role("button", name="Get started").click()
        page.fill("#name", name)
        page.fill("#email", email)
        page.fill("#password", password)
        page.click("button[type=submit]")
        page.wait_for_selector("#chat-input")
        # A new account is greeted by the release notes, over the chat page (if the release
        # has any).
        with contextlib.suppress(PlaywrightError):
            page.get_by_role("button", name="Okay, Let's Go!").click(timeout=15_000)

    @property
    def token(self) -> str:
        return str(self.page.evaluate("() => localStorage.getItem('token')"))

    def api(self, path: str) -> Any:
        r = httpx.get(
            f"{self.url}/api{path}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        )
        r.raise_for_status()
        return r.json()

    def select_model(self, model_id: str) -> None:
        page = self.page
        page.click("#model-selector-model-button")
        page.click(f"[role=option][data-value='{model_id}']")
        expect(page.locator("#model-selector-model-button")).to_have_attribute(
            "aria-label", f"Selected model: {model_id}"
        )

    @property
    def chat_id(self) -> str:
        match = CHAT_URL.match(self.page.url)
        assert match, f"not on a chat's page: {self.page.url}"
        return match[1]

    def ask(self, question: str, timeout: float) -> Reply:
        """Type `question`, send it, and wait until its reply is done (or failed)."""
        page = self.page
        page.locator("#chat-input").fill(question)
        page.locator("#chat-input").press("Enter")
        expect(page).to_have_url(CHAT_URL)
        chat_id = self.chat_id
        deadline = time.monotonic() + timeout
        while True:
            reply = self._reply_to(chat_id, question)
            if reply is not None and (reply.get("done") or reply.get("error")):
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no reply to {question!r} in Open WebUI after {timeout:.0f} s "
                    f"(its record of the turn: {reply})"
                )
            time.sleep(1.0)
        body = page.locator(f"#message-{reply['id']} #response-content-container")
        expect(body).not_to_have_text(re.compile(r"^\s*$"))
        return Reply(
            chat_id,
            str(reply["id"]),
            _text(reply),
            _error_text(reply.get("error")),
            body.inner_text(),
        )

    def wait_until_idle(self, timeout: float) -> None:
        """Until the composer's Stop button is gone: Open WebUI shows it until the last reply's
        background tasks (follow-ups, title, tags) are done too."""
        stop = self.page.get_by_role("button", name="Stop")
        expect(stop).to_be_hidden(timeout=timeout * 1000)

    def chat(self, chat_id: str) -> dict[str, Any]:
        """Open WebUI's record of a chat: its title, tags, and the messages' tree."""
        return self.api(f"/v1/chats/{chat_id}")  # type: ignore[no-any-return]

    def _reply_to(self, chat_id: str, question: str) -> dict[str, Any] | None:
        messages = self.chat(chat_id)["chat"]["history"]["messages"]
        asked = [m for m in messages.values() if m["role"] == "user" and m["content"] == question]
        if not asked or not asked[-1].get("childrenIds"):
            return None
        return messages.get(asked[-1]["childrenIds"][-1])  # type: ignore[no-any-return]
