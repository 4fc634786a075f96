"""The web pages: the chat at `/`, the operator view at `/admin`, their files under `/static`.

Plain HTML, CSS and JavaScript files (marked and DOMPurify vendored under static/vendor), no
build step. Every page and file is sent with a Content-Security-Policy that allows scripts,
styles and connections (fetch and the WebSocket) from this origin only, and no inline script:
what a model writes is sanitized before it is shown, and even markup that got through could not
run."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

STATIC = Path(__file__).resolve().parent.parent / "static"

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

router = APIRouter(include_in_schema=False)


def page(name: str) -> FileResponse:
    return FileResponse(
        STATIC / name, media_type="text/html", headers={**PAGE_HEADERS, "Cache-Control": "no-cache"}
    )


@router.get("/", response_class=HTMLResponse)
async def chat_page() -> FileResponse:
    return page("index.html")


@router.get("/admin", response_class=HTMLResponse)
async def admin_page() -> FileResponse:
    return page("admin.html")


class StaticFilesWithHeaders(StaticFiles):
    """The page files, with the pages' security headers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        *((k.lower().encode(), v.encode()) for k, v in PAGE_HEADERS.items()),
                    ],
                }
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


def static_files() -> StaticFiles:
    return StaticFilesWithHeaders(directory=STATIC)
