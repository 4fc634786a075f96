"""The README's picture of Open WebUI (docs/open-webui.png): its own page, in headless Chromium
(Debian's `chromium`, driven by Playwright), chatting with a started `kvchat serve` of a real
model through kvchat's OpenAI API, after two questions and Open WebUI's background tasks.

    make screenshot-open-webui             # models/smollm2-135m-instruct, docs/open-webui.png
    PYTHONPATH=tests/support .venv/bin/python -P docs/open_webui_screenshot.py --model DIR

Open WebUI (the version tests/app/transports/test_open_webui.py pins) is installed from PyPI
on first use, as that test does. Replies and tasks are greedy (temperature 0, set as Open
WebUI's default model and task parameters), so the picture is the same each time it runs on
the same weights."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from kvchat_testing import chromium
from kvchat_testing.open_webui import KVCHAT_ENV, OpenWebUI
from kvchat_testing.open_webui_page import OpenWebUIPage
from kvchat_testing.service import Server

QUESTIONS = ("What is the capital of France?", "What is a famous museum there?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--out", type=Path, default=Path("docs/open-webui.png"))
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as data:
        server = Server(args.model.resolve(), Path(data) / "kvchat", env=KVCHAT_ENV)
        server.start(timeout=600)
        assert server.key is not None
        params = {
            "DEFAULT_MODEL_PARAMS": json.dumps({"max_tokens": args.max_tokens, "temperature": 0}),
            "TASK_MODEL_PARAMS": json.dumps({"max_tokens": 64, "temperature": 0}),
        }
        ui = OpenWebUI(f"{server.url}/v1", server.key, Path(data) / "open-webui", params)
        try:
            ui.start()
            models = httpx.get(f"{server.url}/v1/models", headers=server.headers(), timeout=30)
            model = models.json()["data"][0]["id"]
            with sync_playwright() as playwright:
                browser = chromium.launch(playwright)
                page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
                chat = OpenWebUIPage(page, ui.url)
                chat.sign_up("kvchat", "admin@kvchat.example", "kvchat-screenshot")
                chat.select_model(model)
                replies = [chat.ask(question, timeout=900) for question in QUESTIONS]
                failed = [f"{q!r}: {r.error}" for q, r in zip(QUESTIONS, replies) if r.error]
                if failed:  # no picture of error bubbles
                    raise SystemExit("Open WebUI got no reply to " + "; ".join(failed))
                chat.wait_until_idle(timeout=900)
                page.screenshot(path=str(args.out))
                browser.close()
        finally:
            ui.stop()
            server.stop()
    print(f"model: {model}")
    for question, reply in zip(QUESTIONS, replies):
        print(f"> {question}\n{reply.error or reply.content.strip()}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
