"""Keys in logged URLs are redacted (the browser's WebSocket passes its key as a query
parameter; uvicorn logs paths with their query), however the parameter's name is encoded: the
filter reads names as Starlette does. Unit tests over the encodings, and `kvchat serve` as a
process at debug level, driven with the key under each encoding, whose whole output must not
hold the key."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import string
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from starlette.datastructures import QueryParams
from uvicorn.logging import AccessFormatter

from kvchat.app.ops.log_redaction import REDACTED, RedactSecrets, install, redact
from kvchat_testing.service import Server

# (query, whether Starlette reads the key from it as `access_token`, i.e. the WebSocket
# authenticates). {key} is the key, {other} another secret, {encoded_key} the key with every
# byte percent-encoded. The literal `access_token=` / `api_key=` (any case) was redacted before;
# every row here was not.
ENCODINGS: list[tuple[str, bool]] = [
    ("access%5Ftoken={key}", True),
    ("access%5ftoken={key}", True),
    ("%61ccess_token={key}", True),
    ("%61%63%63%65%73%73%5F%74%6F%6B%65%6E={key}", True),
    ("access%5Ftoken={encoded_key}", True),
    ("x=1&%61ccess%5Ftoken={key}&y=2", True),
    ("access_token={other}&access%5Ftoken={key}", True),  # repeated: Starlette reads the last
    ("access%5Ftoken={key}&access%5Ftoken={other}", False),
    ("ACCESS%5FTOKEN={key}", False),  # Starlette's lookup is case-sensitive; redaction is not
    ("Access%5Ftoken={key}", False),
    ("access_token+={key}", False),
    ("access_token%20={key}", False),
    ("%20access_token={key}", False),
    ("%2561ccess_token={key}", False),  # as a proxy that decodes once more reads it
    ("x=1;access%5Ftoken={key}", False),
    ("api%5Fkey={key}", False),
    ("API%5FKEY={key}", False),
    ("%61pi_key={key}", False),
    ("api_key+={key}", False),
]


def new_key() -> str:
    return "kvc-" + secrets.token_urlsafe(32)


def percent_encoded(text: str) -> str:
    return "".join(f"%{byte:02X}" for byte in text.encode())


def filled(query: str, key: str, other: str) -> str:
    return query.format(key=key, other=other, encoded_key=percent_encoded(key))


def redacted(query: str) -> str:
    return query.format(key=REDACTED, other=REDACTED, encoded_key=REDACTED)


@pytest.mark.parametrize(("query", "reads_as_access_token"), ENCODINGS)
def test_every_encoding_of_a_secret_name_is_redacted(
    query: str, reads_as_access_token: bool
) -> None:
    key, other = new_key(), new_key()
    raw = filled(query, key, other)
    assert (QueryParams(raw).get("access_token") == key) is reads_as_access_token
    for line in (
        f"/v1/conversations/c/ws?{raw}",
        f'"GET /v1/models?{raw} HTTP/1.1" 401',
        f'"WebSocket /v1/conversations/c/ws?{raw}" [accepted]',
    ):
        expected = line.replace(raw, redacted(query))
        assert redact(line) == expected
        assert redact(expected) == expected  # redacting twice (logger, then handler) is one


def test_the_literal_names_stay_redacted_and_lookalikes_stay() -> None:
    key = new_key()
    assert (
        redact(f"/v1/conversations/c/ws?access_token={key}&x=1")
        == "/v1/conversations/c/ws?access_token=[redacted]&x=1"
    )
    assert redact(f'GET /x?API_KEY={key} HTTP/1.1"') == 'GET /x?API_KEY=[redacted] HTTP/1.1"'
    assert redact(f"/x?next=/y?access_token={key}") == "/x?next=/y?access_token=[redacted]"
    assert redact(f"/x?access_token='{key}") == "/x?access_token=[redacted]"
    assert redact(f"/x?access_token={key}?x=1&y=2") == "/x?access_token=[redacted]&y=2"
    for kept in (
        "/x?monkey_access_token=keep&turkey=1",
        "/x?x-access_token=k&access_tokens=k",
        "/x?access+token=k&apikey=k&api_keys=k&token=k",
        "/x?access_token=&api_key",
        "no secrets here",
        "100% = done",
    ):
        assert redact(kept) == kept


def test_other_parameters_are_kept_byte_for_byte() -> None:
    key = new_key()
    line = f"/ws?a=%2F%20+b&access%5Ftoken={key}&c=%E2%9C%93&d&e=&f=a=b&%C3%A9=%zz&g=%2525&h=x;y"
    assert redact(line) == line.replace(key, REDACTED)


SECRET_NAMES = ("access_token", "api_key")
OTHER_NAMES = (
    "x",
    "q",
    "next",
    "monkey_access_token",
    "access_tokens",
    "x-access_token",
    "api_keys",
    "apikey",
    "access-token",
    "access token",
    "token",
    "key",
    "é",
)
VALUE_CHARS = string.ascii_letters + string.digits + "-._~=;/:"


def random_spelling(rng: random.Random, name: str, *, any_case: bool) -> str:
    """name as a client may spell it: each byte literal or percent-encoded (either hex case),
    letters in any case where asked, a space as `+` or `%20`."""
    out = []
    for char in name:
        if any_case and rng.random() < 0.3:
            char = char.swapcase()
        choice = rng.random()
        if char == " ":
            out.append(rng.choice(("+", "%20")))
        elif choice < 0.4 or not char.isascii():
            hex_byte = "".join(f"%{b:02X}" for b in char.encode())
            out.append(hex_byte.lower() if rng.random() < 0.5 else hex_byte)
        else:
            out.append(char)
    return "".join(out)


def random_value(rng: random.Random) -> str:
    return "".join(
        rng.choice(VALUE_CHARS)
        if rng.random() < 0.8
        else rng.choice(("%2F", "%20", "+", "%E2%9C%93"))
        for _ in range(rng.randrange(12))
    )


def test_random_queries_lose_only_their_secret_values() -> None:
    """Fresh random queries mixing secret names (spelled any way Starlette reads them, in any
    case) and other names: the redacted query is the query with exactly the secret values
    replaced, and Starlette reads the same names from it."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(300):
        raw, expected, keys = [], [], []
        for _ in range(rng.randrange(1, 7)):
            if rng.random() < 0.4:
                name = random_spelling(rng, rng.choice(SECRET_NAMES), any_case=True)
                key = new_key()
                value = percent_encoded(key) if rng.random() < 0.3 else key
                keys.append(key)
                raw.append(f"{name}={value}")
                expected.append(f"{name}={REDACTED}")
            else:
                name = random_spelling(rng, rng.choice(OTHER_NAMES), any_case=False)
                piece = f"{name}={random_value(rng)}" if rng.random() < 0.9 else name
                raw.append(piece)
                expected.append(piece)
        query = "&".join(raw)
        result = redact(f"/v1/models?{query}")
        assert result == f"/v1/models?{'&'.join(expected)}", f"seed {seed}: {query}"
        assert [n for n, _ in QueryParams(result.partition("?")[2]).multi_items()] == [
            n for n, _ in QueryParams(query).multi_items()
        ], f"seed {seed}: {query}"
        assert not any(k in result or percent_encoded(k) in result for k in keys), seed


def record(name: str, msg: str, args: tuple[object, ...]) -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


def test_the_filter_rewrites_uvicorn_style_records() -> None:
    key = new_key()
    accepted = record(
        "uvicorn.error",
        '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5000", f"/v1/conversations/c/ws?access%5Ftoken={key}"),
    )
    assert RedactSecrets().filter(accepted)
    assert (
        accepted.getMessage()
        == '127.0.0.1:5000 - "WebSocket /v1/conversations/c/ws?access%5Ftoken=[redacted]" '
        "[accepted]"
    )
    access = record(
        "uvicorn.access",
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", f"/v1/models?%61pi_key={key}&x=%2F", "1.1", 401),
    )
    assert RedactSecrets().filter(access)
    # uvicorn's access formatter unpacks the five arguments: the record keeps its shape
    line = AccessFormatter(
        '%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False
    ).format(access)
    assert (
        line == '127.0.0.1:5000 - "GET /v1/models?%61pi_key=[redacted]&x=%2F HTTP/1.1" '
        "401 Unauthorized"
    )


def test_a_secret_split_between_message_and_arguments_or_inside_an_object() -> None:
    key = new_key()
    split = record("kvchat", "GET /x?access_token=%s", (key,))
    assert RedactSecrets().filter(split)
    assert split.getMessage() == "GET /x?access_token=[redacted]"
    # uvicorn.asgi at trace level logs the ASGI scope, its raw query among its bytes
    scope = record(
        "uvicorn.asgi",
        "%s - ASGI [%d] Started scope=%s",
        (
            "127.0.0.1:5000",
            3,
            {"type": "websocket", "query_string": f"%61ccess_token={key}".encode()},
        ),
    )
    assert RedactSecrets().filter(scope)
    assert (
        scope.getMessage() == "127.0.0.1:5000 - ASGI [3] Started scope="
        "{'type': 'websocket', 'query_string': b'%61ccess_token=[redacted]'}"
    )
    # websockets logs a socket's request headers at debug level, with or without a scheme
    for value in (f"Bearer {key}", key, f"bearer  {key}"):
        header = record("uvicorn.error", "< %s: %s", ("authorization", value))
        assert RedactSecrets().filter(header)
        assert header.getMessage() == "< authorization: [redacted]"
    assert redact(f"{{'authorization': 'Bearer {key}'}}") == "{'authorization': '[redacted]'}"
    assert redact(f"retried (Bearer {key}, 2 times)") == "retried (Bearer [redacted], 2 times)"


def test_a_record_without_secrets_is_left_as_it_is() -> None:
    args = ("127.0.0.1:5000", "GET", "/v1/models?limit=5&after=%2F", "1.1", 200)
    plain = record("uvicorn.access", '%s - "%s %s HTTP/%s" %d', args)
    assert RedactSecrets().filter(plain)
    assert plain.args is args and plain.msg == '%s - "%s %s HTTP/%s" %d'
    broken = record("kvchat", "%d replies", ("many",))  # the handler reports the bad format
    assert RedactSecrets().filter(broken)
    assert broken.args == ("many",)


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
        logger.warning("GET %s", "/ws?access%5Ftoken=sk-x")
        assert seen == ["GET /ws?access%5Ftoken=[redacted]"]
    finally:
        logger.removeHandler(handler)


# The served test: one `kvchat serve` for the module, at debug level (uvicorn's access and
# WebSocket lines, kvchat's and the libraries' debug lines; `trace`, which would add uvicorn's
# ASGI scope dumps, is refused by `kvchat serve`'s logging setup, so the unit test above covers
# those records).


async def create_key(data_dir: Path) -> str:
    """A key made before the server starts, so the server never prints it."""
    from kvchat.app.store import Store, default_database_url

    async with await Store.open(default_database_url(data_dir)) as store:
        _, key = await store.create_key("browser")
    return key


@pytest.fixture(scope="module")
def debug_server(dev_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("redaction")
    key = asyncio.run(create_key(data_dir))
    server = Server(dev_model, data_dir, env={"KVCHAT_LOG_LEVEL": "debug"}, key=key).start()
    try:
        yield server
    finally:
        server.stop()


async def open_socket(url: str, headers: dict[str, str] | None = None) -> int | None:
    """Ping over the socket: None if it answered (the key was accepted), else the close code."""
    async with websockets.connect(url, additional_headers=headers) as ws:
        try:
            await ws.send(json.dumps({"type": "ping"}))
            frame = json.loads(await ws.recv())
        except websockets.ConnectionClosed as closed:
            return closed.rcvd.code if closed.rcvd is not None else -1
    assert frame["type"] == "pong", frame
    return None


def test_a_served_key_never_reaches_the_output(debug_server: Server) -> None:
    server = debug_server
    assert server.key is not None
    key, other = server.key, new_key()
    conv = httpx.post(
        f"{server.url}/v1/conversations", json={}, headers=server.headers(), timeout=30
    ).json()["id"]
    ws_base = f"ws://127.0.0.1:{server.port}/v1/conversations/{conv}/ws"

    async def sockets() -> list[int | None]:
        return [await open_socket(f"{ws_base}?{filled(q, key, other)}") for q, _ in ENCODINGS]

    closes = asyncio.run(sockets())
    # websockets logs a socket's request headers at debug level, Authorization among them
    assert asyncio.run(open_socket(ws_base, server.headers())) is None
    for (query, reads_as_access_token), close in zip(ENCODINGS, closes):
        # the encoded name authenticates the socket by itself, or the key is refused
        assert close == (None if reads_as_access_token else 4401), query
        raw = filled(query, key, other)
        r = httpx.get(f"{server.url}/v1/models?{raw}", headers=server.headers(), timeout=30)
        assert r.status_code == 200, (query, r.text)
        assert httpx.get(f"{server.url}/v1/models?{raw}", timeout=30).status_code == 401
    server.stop()
    deadline = time.monotonic() + 60  # a safety net: the line comes once the output is read
    while not any("Finished server process" in line for line in server.output):
        assert time.monotonic() < deadline, "".join(server.output[-50:])
        time.sleep(0.05)
    output = "".join(server.output)
    for secret in (key, percent_encoded(key), other, key[len("kvc-") :]):
        leaks = [line for line in server.output if secret in line]
        assert not leaks
    for query, _ in ENCODINGS:  # each request was logged, redacted, by each kind of line
        q = redacted(query)
        assert f'"GET /v1/models?{q} HTTP/1.1" 200' in output, q
        assert f'"GET /v1/models?{q} HTTP/1.1" 401' in output, q
        assert f'"WebSocket /v1/conversations/{conv}/ws?{q}" [accepted]' in output, q
    assert "< authorization: [redacted]" in output
