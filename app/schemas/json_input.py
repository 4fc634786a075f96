"""What every request body and WebSocket frame must be once parsed, before any model validates
it: JSON nested at most MAX_JSON_DEPTH levels, whose text (every string, object keys included)
is valid Unicode without U+0000.

Lone UTF-16 surrogates (`"\\ud800"` is valid JSON) cannot be stored or sent back as UTF-8, and
Postgres cannot store NUL in text; rejecting both here, with the path of the first offending
string as `param` (`messages.0.content`), gives one behaviour on every route, frame and
database. Depth is measured without recursion; the parser's own recursion limit (about 1,000
levels) is reported as too deep as well."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 100

_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
_RAW_SURROGATE = re.compile("[\ud800-\udfff]")
_SUSPECT_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")  # \u0000, \ud800 to \udfff
_CONTAINERS = frozenset((dict, list))


class JSONInputError(ValueError):
    """A body or frame refused before validation. `code`: json_too_deep, invalid_unicode or
    invalid_json; `param`: where (None for the whole document)."""

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def parse_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of `raw` (bytes must be UTF-8), nested at most `max_depth` containers
    deep, every string in it (keys included) valid Unicode without NUL. Text that is not JSON
    raises json.JSONDecodeError, as json.loads does; everything else refused is a
    JSONInputError: bytes that are not UTF-8, nesting too deep (past json.loads's own recursion
    limit too), an integer of more than 4,300 digits, bad text."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")  # strict: no encoded surrogates either
        except UnicodeDecodeError:
            raise JSONInputError("The body is not valid UTF-8.", None, "invalid_unicode") from None
        has_raw_surrogates = False
    else:
        text = raw
        has_raw_surrogates = not text.isascii() and _RAW_SURROGATE.search(text) is not None
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONInputError(
            f"The JSON is nested more than {max_depth} levels deep.", None, "json_too_deep"
        ) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:
        raise JSONInputError(f"The JSON cannot be read: {e}", None, "invalid_json") from None
    _check_depth(value, max_depth)
    # Bad text in valid UTF-8 can only come from an escape (\u0000, \ud800), which a scan at C
    # speed finds; only then is every string visited, to name the first bad one. (Surrogate
    # pairs, and a literal backslash before u0000, match too: they cost that visit, no more.)
    if has_raw_surrogates or _SUSPECT_ESCAPE.search(text):
        _check_texts(value)
    return value


def json_depth(value: Any) -> int:
    """How many containers deep `value` nests (0 for a scalar, 1 for `{}`), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            stack += [(item, depth + 1) for item in node]
    return deepest


def _check_depth(value: Any, max_depth: int) -> None:
    """Containers only, each with its depth and the top-level field it is under; a container
    of scalars is passed over at C speed (the set of its items' types)."""
    if type(value) not in _CONTAINERS:
        return
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if depth > max_depth:
            raise _error(
                (field,) if field else (),
                f"nested more than {max_depth} levels deep",
                "json_too_deep",
            )
        values = node.values() if type(node) is dict else node
        if _CONTAINERS.isdisjoint(set(map(type, values))):
            continue
        items = node.items() if type(node) is dict else enumerate(node)
        for key, item in items:
            if type(item) in _CONTAINERS:
                top = field if depth > 1 else (key if isinstance(key, str) else None)
                stack.append((item, depth + 1, top))


def _check_texts(value: Any) -> None:
    """Every string and key, with its path; raises at the first bad one."""
    if isinstance(value, str):
        _check_text(value, (), key=False)
        return
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, (*path, key), key=True)
            if isinstance(item, str):
                _check_text(item, (*path, key), key=False)
            elif isinstance(item, dict | list):
                stack.append((item, (*path, key)))


def _check_text(text: str, path: tuple[str | int, ...], *, key: bool) -> None:
    bad = _BAD_TEXT.search(text)
    if bad is None:
        return
    char = bad.group()
    what = (
        "U+0000 (NUL), which is not accepted in text"
        if char == "\x00"
        else (f"a lone surrogate (U+{ord(char):04X}), which is not valid Unicode")
    )
    if key:
        raise JSONInputError(
            f"Invalid key '{_param(path)}': it holds {what}.", _param(path), "invalid_unicode"
        )
    raise _error(path, f"the text holds {what}", "invalid_unicode")


def _param(path: tuple[str | int, ...]) -> str | None:
    """A path as OpenAI names params (`messages.0.content`); text that could not be sent back
    as UTF-8 (the offending key itself) is shown escaped."""
    parts = [
        json.dumps(p)[1:-1] if isinstance(p, str) and _BAD_TEXT.search(p) else str(p) for p in path
    ]
    return ".".join(parts) or None


def _error(path: tuple[str | int, ...], problem: str, code: str) -> JSONInputError:
    param = _param(path)
    message = (
        f"Invalid value for '{param}': {problem}."
        if param
        else (
            f"The JSON is {problem}."
            if code == "json_too_deep"
            else f"{problem[0].upper()}{problem[1:]}."
        )
    )
    return JSONInputError(message, param, code)
