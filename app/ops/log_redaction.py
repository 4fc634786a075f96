"""Keys never reach a log: browsers pass the WebSocket's key as the `access_token` query
parameter (they cannot set headers on a WebSocket), and uvicorn logs every request's path with
its raw query (access lines, `"WebSocket <path>" [accepted]` lines, the ASGI scope at trace
level); at debug level websockets logs a socket's request headers, Authorization among them. A
filter on the log handlers rewrites the secrets before anything is written.

Starlette reads a query the way `urllib.parse.parse_qsl` does: split on `&`, the name before
the first `=`, `+` as a space, then percent-decoding (UTF-8, bad bytes replaced). So
`?access%5Ftoken=KEY` and `?%61ccess_token=KEY` authenticate just as `?access_token=KEY` does,
and a parameter is matched here by its name as Starlette decodes it, never by its raw text."""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

SECRET_NAMES = ("access_token", "api_key")
REDACTED = "[redacted]"

# A line can hold a secret only if it has a `%` (a name that decodes to a secret one has one;
# `+` decodes to a space only) or one of these words; most lines have neither.
_HINT_WORDS = ("authorization", "bearer", *SECRET_NAMES)
# A parameter's raw name and its `=`. A name starts after whitespace, `?`, `&` or `=` (so a
# value such as `next=/x?access_token=KEY` is searched too); the lookbehind keeps the scan
# linear (no retry from every character of a long path).
_NAME_EQ = re.compile(r"(?<![^\s?&=])[^\s?&=]*=")
# A value runs to the next `&` or whitespace (a logged path holds no raw whitespace)...
_VALUE_END = re.compile(r"[\s&]")
# ...less the quotes and punctuation that close the text around it (`"WebSocket /p?q=v" ...`);
# never `]`, so that `[redacted]` redacts to itself.
_CLOSING = re.compile(r"[\"'),;.>}]+$")
# The decoded name, case-insensitively, with surrounding whitespace, and after anything but a
# word character or `-` (as `?`, `&`, `"` decoded from `%3F`, `%26`, `%22`): `x-access_token`
# and `monkey_access_token` are other parameters.
_SECRET_NAME = re.compile(r"(?:^|[^\w-])(?:" + "|".join(SECRET_NAMES) + r")\s*$", re.IGNORECASE)
# Starlette decodes once; a proxy in front may decode once more. Four rounds bound the work a
# crafted `%252525...` name can cost.
_MAX_DECODES = 4
# An Authorization header's credentials (websockets logs a socket's request headers at debug
# level), with or without a scheme, and a bearer token anywhere.
_AUTHORIZATION = re.compile(
    r"(\bauthorization[\"']?\s*[:=]\s*[\"']?)(?:[a-z]+\s+)?[^\s\"',;&]+", re.IGNORECASE
)
_BEARER = re.compile(r"(\bbearer\s+)[^\s\"',;&]+", re.IGNORECASE)


def is_secret_name(raw_name: str) -> bool:
    """Whether a raw (still percent-encoded) parameter name reads as a secret one, as given or
    after any of up to four rounds of Starlette's decoding."""
    name = raw_name
    for _ in range(_MAX_DECODES):
        if _SECRET_NAME.search(name):
            return True
        decoded = unquote_plus(name)  # parse_qsl's decoding: '+' is ' ', UTF-8, errors replaced
        if decoded == name:
            return False
        name = decoded
    return _SECRET_NAME.search(name) is not None


def redact_params(text: str) -> str:
    """text with the value of every parameter whose name reads as a secret one replaced by
    `[redacted]` (the whole raw value, however it is encoded); every other byte is kept."""
    pieces: list[str] = []
    done = 0  # text[:done] is in pieces
    for match in _NAME_EQ.finditer(text):
        if match.start() < done or not is_secret_name(match.group()[:-1]):
            continue  # inside a value already redacted, or another parameter
        start = match.end()
        stop = _VALUE_END.search(text, start)
        end = len(text) if stop is None else stop.start()
        closing = _CLOSING.search(text, start, end)
        if closing is not None:
            end = closing.start()
        if end == start:
            continue  # an empty value hides nothing
        pieces += (text[done:start], REDACTED)
        done = end
    return "".join(pieces) + text[done:] if pieces else text


def redact(text: str) -> str:
    """text with secret query parameters' values, Authorization headers' credentials and
    bearer tokens replaced by `[redacted]`. A line with no `%` and none of the hint words (most
    lines) costs a casefold and four substring checks."""
    if "%" not in text:
        folded = text.casefold()
        if not any(word in folded for word in _HINT_WORDS):
            return text
    if "=" in text:
        text = redact_params(text)
    text = _AUTHORIZATION.sub(rf"\1{REDACTED}", text)
    return _BEARER.sub(rf"\1{REDACTED}", text)


def _redact_arg(arg: object) -> object:
    return redact(arg) if isinstance(arg, str) else arg


_DONE = "kvchat_secrets_redacted"  # set on a record the filter has seen


class RedactSecrets(logging.Filter):
    """Rewrites a record so that neither its message nor its arguments hold a secret.

    The message and each string argument are redacted on their own first, so a record keeps
    its shape (uvicorn's access formatter unpacks the five arguments, the path among them). If
    that leaves a secret in the formatted message or breaks its format (a name in the message
    and its value in an argument, a secret inside a non-string argument such as the ASGI scope
    uvicorn logs at trace level), the record becomes its redacted formatted message, without
    arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        # A record meets the filter twice (its logger's, then its handler's): once is enough.
        if getattr(record, _DONE, False):
            return True
        setattr(record, _DONE, True)
        message = _message(record)
        if message is not None and redact(message) == message:
            return True  # the common case: nothing to redact
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redact_arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redact_arg(v) for k, v in record.args.items()}
        parts_message = _message(record)
        if parts_message is not None and redact(parts_message) == parts_message:
            return True
        if message is not None:  # else the handler reports the bad format, parts redacted
            record.msg, record.args = redact(message), ()
        return True


def _message(record: logging.LogRecord) -> str | None:
    """The record's formatted message; None where it does not format (the handler reports
    that, printing the message and arguments, which the filter has redacted by then)."""
    try:
        return record.getMessage()
    except Exception:  # any error of `msg % args`
        return None


LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "kvchat")


def install(names: tuple[str, ...] = LOGGERS) -> None:
    """Add the filter to these loggers and to every handler they have (a logger's filter does
    not see records its children propagate; a handler's does: uvicorn's WebSocket lines and
    its trace-level `uvicorn.asgi` lines reach the `uvicorn` logger's handler, kvchat's and
    the libraries' lines the root's). Call after logging is set up."""
    secret_filter = RedactSecrets()
    for name in names:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, RedactSecrets) for f in target.filters):
                target.addFilter(secret_filter)
