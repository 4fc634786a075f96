"""Keys never reach a log: browsers pass the WebSocket's key as the `access_token` query
parameter (they cannot set headers on a WebSocket), and uvicorn logs every request's path with
its query. A filter on the log handlers rewrites the value before anything is written."""

from __future__ import annotations

import logging
import re

SECRET_PARAMS = re.compile(r"(?<![\w-])((?:access_token|api_key)=)[^&\s\"']+", re.IGNORECASE)
REDACTED = r"\1[redacted]"


def redact(text: str) -> str:
    return SECRET_PARAMS.sub(REDACTED, text)


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v
                           for k, v in record.args.items()}
        return True


LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "kvchat", "app")


def install(names: tuple[str, ...] = LOGGERS) -> None:
    """Add the filter to these loggers and to every handler they have (a logger's filter does
    not see records its children propagate; a handler's does). Call after logging is set up."""
    secret_filter = RedactSecrets()
    for name in names:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, RedactSecrets) for f in target.filters):
                target.addFilter(secret_filter)
