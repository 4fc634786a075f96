"""The README's screenshots, taken from a started `kvchat serve` of a real model in headless
Chromium (Debian's `chromium`, driven by Playwright): the chat page after a three-turn
conversation, and the operator view with its sessions.

    make screenshots                       # models/smollm2-135m-instruct, written to docs/
    PYTHONPATH=tests/support .venv/bin/python -P docs/screenshots.py --model DIR --out DIR

Replies are greedy (temperature 0), so the pictures show what the model answers, and the same
each time it runs on the same weights."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect, sync_playwright

from kvchat_testing.service import Server

QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "What is a famous museum there?",
    "Give me three tips for visiting it.",
)


def chromium_path() -> str:
    for candidate in ("/usr/lib/chromium/chromium", "/usr/bin/chromium"):
        if Path(candidate).exists():
            return candidate
    raise SystemExit("chromium is not installed (apt-get install chromium)")


def ask(page: Page, question: str, turn: int) -> None:
    page.fill("#input", question)
    page.press("#input", "Enter")
    expect(page.locator(".message.assistant")).to_have_count(turn)
    expect(page.locator(".message.assistant").last).to_have_attribute(
        "data-status", "complete", timeout=300_000
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as data:
        server = Server(args.model.resolve(), Path(data)).start(timeout=600)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=chromium_path(),
                    headless=True,
                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
                )
                page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
                page.goto(server.url + "/")
                page.fill("#key-input", server.key or "")
                page.click("#key-form button[type=submit]")
                page.wait_for_selector("#app:not([hidden])")
                page.click("#generation-settings summary")
                page.fill("#max-tokens", str(args.max_tokens))
                page.fill("#temperature", "0")
                page.click("#generation-settings summary")
                for turn, question in enumerate(QUESTIONS, start=1):
                    ask(page, question, turn)
                page.screenshot(path=str(args.out / "chat.png"))
                replies = page.locator(".message.assistant .body").all_text_contents()
                page.goto(server.url + "/admin")
                page.wait_for_selector("#sessions tbody tr")
                page.screenshot(path=str(args.out / "admin.png"), full_page=True)
                browser.close()
            models = httpx.get(
                server.url + "/v1/models", headers=server.headers(), timeout=30
            ).json()
        finally:
            server.stop()
    print(f"model: {models['data'][0]['id']}")
    for question, reply in zip(QUESTIONS, replies):
        print(f"> {question}\n{reply.strip()}\n")
    print(f"wrote {args.out / 'chat.png'} and {args.out / 'admin.png'}")


if __name__ == "__main__":
    main()
