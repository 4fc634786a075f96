"""Keys in logged URLs are redacted (the browser's WebSocket passes its key as a query
parameter; uvicorn logs paths with their query)."""

from __future__ import annotations

import logging

from app.ops.log_redaction import RedactSecrets, install, redact


def test_redact_keeps_everything_but_the_secret() -> None:
    assert redact("/v1/conversations/c/ws?access_token=sk-abc123&x=1") == \
        "/v1/conversations/c/ws?access_token=[redacted]&x=1"
    assert redact('GET /x?API_KEY=secret HTTP/1.1"') == 'GET /x?API_KEY=[redacted] HTTP/1.1"'
    assert redact("/x?monkey_access_token=keep&turkey=1") == "/x?monkey_access_token=keep&turkey=1"
    assert redact("no secrets here") == "no secrets here"


def test_the_filter_rewrites_uvicorn_style_records() -> None:
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5000", "/v1/conversations/c/ws?access_token=sk-live-1"), None,
    )
    assert RedactSecrets().filter(record)
    assert record.getMessage() == \
        '127.0.0.1:5000 - "WebSocket /v1/conversations/c/ws?access_token=[redacted]" [accepted]'


def test_install_covers_handlers_of_the_named_loggers() -> None:
    logger = logging.getLogger("kvchat.test.redaction")
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        install(("kvchat.test.redaction",))
        install(("kvchat.test.redaction",))  # twice: one filter
        assert sum(isinstance(f, RedactSecrets) for f in handler.filters) == 1
        logger.warning("GET %s", "/ws?access_token=sk-x")
        assert seen == ["GET /ws?access_token=[redacted]"]
    finally:
        logger.removeHandler(handler)
