"""An incremental JSON scanner: where a JSON object in model output ends, found a piece of
text at a time (the tool-call parsers hold back text only while it could still be a call)."""

from __future__ import annotations

import math
import re


def run_end(pattern: re.Pattern[str], text: str, pos: int = 0) -> int:
    """End of `pattern`'s match at text[pos]; the run patterns match the empty string too."""
    match = pattern.match(text, pos)
    assert match is not None
    return match.end()


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is beyond double range")
    return value


PARTIAL, COMPLETE, INVALID = "partial", "complete", "invalid"
WS_RUN = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER_RUN = re.compile(r"[0-9eE.+-]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")


class JsonObjectScanner:
    """Where the JSON object (with `any_value`, any JSON value) at text[start] ends, found a
    piece of text at a time.

    `advance(text)` reads what was appended to `text` since the last call (the caller
    passes the whole text each time, its prefix unchanged). status: partial while some
    continuation could still complete the value; complete once its end is read (`end` is the
    index after it; no continuation changes that: a number is complete only once a character
    that cannot continue it follows); invalid as soon as no
    continuation could make it JSON (RFC 8259: Python's NaN and Infinity are not JSON).
    """

    def __init__(self, start: int, *, any_value: bool = False) -> None:
        self.start = start
        self.status = PARTIAL
        self.end = -1  # valid once complete
        self._pos = start
        self._state = "value" if any_value else "object"  # what the next character may be
        self._stack: list[str] = []  # open containers, "{" or "["
        self._is_key = False  # the open string is an object key
        self._token_start = 0  # of the open number or literal
        self._hex_left = 0  # digits still due in a \\uXXXX escape

    def advance(self, text: str) -> None:
        i, n = self._pos, len(text)
        while i < n and self.status == PARTIAL:
            i = self._step(text, i)
        self._pos = i

    def _step(self, text: str, i: int) -> int:
        """Reads from text[i]; returns the next index to read."""
        state = self._state
        if state == "string":
            i = run_end(_STRING_RUN, text, i)
            if i == len(text):
                return i
            char = text[i]
            if char == '"':
                if self._is_key:
                    self._state = "colon"
                else:
                    self._after_value(i + 1)
            elif char == "\\":
                self._state = "escape"
            else:  # a raw control character
                self.status = INVALID
            return i + 1
        char = text[i]
        if state == "escape":
            if char == "u":
                self._state, self._hex_left = "unicode", 4
            elif char in '"\\/bfnrt':
                self._state = "string"
            else:
                self.status = INVALID
            return i + 1
        if state == "unicode":
            if char not in _HEX_DIGITS:
                self.status = INVALID
            self._hex_left -= 1
            if self._hex_left == 0:
                self._state = "string"
            return i + 1
        if state == "number":
            end = run_end(_NUMBER_RUN, text, i)
            token = text[self._token_start : end]
            if not _NUMBER_PREFIX.fullmatch(token):
                self.status = INVALID
            elif end < len(text):  # the number ended
                if _NUMBER.fullmatch(token):
                    self._after_value(end)
                else:
                    self.status = INVALID
            return end
        if state == "literal":
            token = text[self._token_start : i + 1]
            if token in _LITERALS:
                self._after_value(i + 1)
            elif not any(literal.startswith(token) for literal in _LITERALS):
                self.status = INVALID
            return i + 1
        if char in " \t\n\r":
            return run_end(WS_RUN, text, i)
        if state == "object":
            if char == "{":
                self._open(char)
            else:
                self.status = INVALID
        elif state in ("value", "value_or_end"):
            if char == "]" and state == "value_or_end":
                self._close(i)
            elif char in "{[":
                self._open(char)
            elif char == '"':
                self._state, self._is_key = "string", False
            elif char == "-" or "0" <= char <= "9":
                self._state, self._token_start = "number", i
                return i  # the number state reads it
            elif char in "tfn":
                self._state, self._token_start = "literal", i
                return i
            else:
                self.status = INVALID
        elif state in ("key", "key_or_end"):
            if char == '"':
                self._state, self._is_key = "string", True
            elif char == "}" and state == "key_or_end":
                self._close(i)
            else:
                self.status = INVALID
        elif state == "colon":
            if char == ":":
                self._state = "value"
            else:
                self.status = INVALID
        else:  # after_value
            container = self._stack[-1]
            if char == ",":
                self._state = "key" if container == "{" else "value"
            elif char == ("}" if container == "{" else "]"):
                self._close(i)
            else:
                self.status = INVALID
        return i + 1

    def _open(self, char: str) -> None:
        self._stack.append(char)
        self._state = "key_or_end" if char == "{" else "value_or_end"

    def _close(self, i: int) -> None:
        self._stack.pop()
        self._after_value(i + 1)

    def _after_value(self, end: int) -> None:
        """A value ended before text[end]: the top-level one completes the scan."""
        if self._stack:
            self._state = "after_value"
        else:
            self.status, self.end = COMPLETE, end
