"""bench/tool_calls.py's glue: a BFCL case as the Chat Completions request every server gets, a
server's response read into the result BFCL's checker is given, and what counts as malformed;
then real BFCL cases and BFCL's own verdicts on known-right and known-wrong answers, from
bfcl-eval in a venv of its own (never kvchat's), built on first use and kept between runs on
one machine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from kvchat.bench.tool_calls import (
    CategoryRun,
    Reply,
    bfcl_python,
    load_runs,
    read_reply,
    request_body,
    reusable,
    save_runs,
    unused,
)
from kvchat_testing.real_model import cache_dir

BENCH = Path(__file__).resolve().parents[2] / "bench"


def response(
    calls: list[tuple[str, Any]] | None, content: str | None = None, finish: str = "tool_calls"
) -> dict[str, Any]:
    """An OpenAI Chat Completions response body with these calls (name, arguments)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls is not None:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ]
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 17},
    }


def reply_to(
    case_id: str,
    body: dict[str, Any],
    status: int = 200,
    offered: tuple[str, ...] = ("get_weather", "math_factorial"),
) -> Reply:
    reply = Reply("s", case_id, case_id.rsplit("_", 1)[0], frozenset(offered))
    read_reply(reply, status, body)
    return reply


def test_request_carries_the_case_as_it_is_and_the_same_settings_for_every_server() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "math_factorial",
                "description": "n!",
                "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "What is 5 factorial?"}]
    case = {"id": "simple_python_1", "category": "simple_python", "messages": messages}
    body = request_body(case | {"tools": tools}, "m", max_tokens=77)
    assert body == {
        "model": "m",
        "messages": messages,
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": 0,
        "max_tokens": 77,
    }


def test_a_response_is_read_into_the_result_bfcl_records() -> None:
    two = reply_to(
        "parallel_0", response([("get_weather", '{"city":"Oslo"}'), ("get_weather", "{}")])
    )
    assert two.status == 200 and two.finish_reason == "tool_calls"
    assert two.completion_tokens == 17
    assert two.result == [{"get_weather": '{"city":"Oslo"}'}, {"get_weather": "{}"}]
    # No tool_calls: the content, as BFCL's handler records it (an empty list stays a list)
    prose = reply_to("irrelevance_3", response(None, "It is sunny.", "stop"))
    assert prose.result == "It is sunny." and prose.tool_calls is None
    assert reply_to("irrelevance_3", response([], "x", "stop")).result == []
    assert reply_to("irrelevance_3", response(None, None, "stop")).result is None
    refused = reply_to(
        "simple_python_0",
        {"error": {"message": "this model's chat template does not support tools"}},
        status=400,
    )
    assert refused.status == 400 and refused.error_type == "http_error"
    assert refused.error == "HTTP 400: this model's chat template does not support tools"
    assert not refused.valid and refused.malformed is None  # an error, not a malformed reply


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (response([("get_weather", '{"city": "Oslo"}')]), None),
        (response([("get_weather", "{}"), ("math_factorial", '{"number": 5}')]), None),
        (response([("get_time", "{}")]), "call to a function not offered"),
        (response([("get_weather", "{}"), ("get_time", "{}")]), "call to a function not offered"),
        (response([("get_weather", '{"city": "Oslo"')]), "arguments not a JSON object"),
        (response([("get_weather", '["Oslo"]')]), "arguments not a JSON object"),
        (response([("get_weather", "")]), "arguments not a JSON object"),
        (response([("get_weather", {"city": "Oslo"})]), "arguments not a JSON object"),
        (response([("get_weather", "{}")], finish="length"), None),  # whole calls, then cut
        (response(None, "It is sunny in Oslo.", "stop"), None),
        (response(None, None, "stop"), None),  # an empty answer is plain (if no help)
        (response([], "Sure.", "stop"), None),
        (response(None, "{", "stop"), "unparsed call in content"),
        (response(None, '  [{"name": "get_weather"}]', "stop"), "unparsed call in content"),
        (response(None, 'Sure. <tool_call>{"name": "x"}', "stop"), "unparsed call in content"),
        # cut off at max_tokens: prose is still plain; nothing at all is a swallowed call
        (response(None, "It is sunny in", "length"), None),
        (response(None, None, "length"), "cut off at max_tokens, nothing readable"),
        (response(None, " \n", "length"), "cut off at max_tokens, nothing readable"),
        (response([], None, "length"), "cut off at max_tokens, nothing readable"),
    ],
)
def test_malformed(body: dict[str, Any], why: str | None) -> None:
    assert reply_to("simple_python_0", body).malformed == why


# Run in bfcl-eval's venv: real cases, and BFCL's verdicts on the replies given on stdin.
DRIVER = """
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
os.environ["BFCL_PROJECT_ROOT"] = tempfile.mkdtemp()
import bfcl_cases
out = {
    "cases": bfcl_cases.load_cases(["simple_python", "parallel", "irrelevance"], 2),
    "verdicts": bfcl_cases.score(json.load(sys.stdin)),
}
open(sys.argv[2], "w").write(json.dumps(out))
"""


def test_real_cases_and_bfcl_verdicts(tmp_path: Path) -> None:
    # (case, response, BFCL's verdict: valid, or the start of its error type)
    known: list[tuple[str, dict[str, Any], str | bool]] = [
        (
            "simple_python_0",
            response([("calculate_triangle_area", '{"base":10,"height":5}')]),
            True,
        ),
        (
            "simple_python_0",
            response([("calculate_triangle_area", '{"base":10,"height":5,"unit":"units"}')]),
            True,
        ),
        (
            "simple_python_0",
            response([("calculate_triangle_area", '{"base":11,"height":5}')]),
            "value_error",
        ),
        (
            "simple_python_0",
            response([("calculate_triangle_area", '{"base":10}')]),
            "simple_function_checker:missing_required",
        ),
        # BFCL's `math.factorial`, offered as math_factorial: OpenAI names allow no dots
        ("simple_python_1", response([("math_factorial", '{"number":5}')]), True),
        ("simple_python_1", response(None, "5! = 120", "stop"), "ast_decoder"),
        (
            "parallel_0",
            response(
                [
                    ("spotify_play", '{"artist":"Maroon 5","duration":15}'),
                    ("spotify_play", '{"artist":"Taylor Swift","duration":20}'),
                ]
            ),
            True,
        ),
        (
            "parallel_0",
            response([("spotify_play", '{"artist":"Maroon 5","duration":15}')]),
            "parallel_function_checker_no_order:wrong_count",
        ),
        ("irrelevance_0", response(None, "I cannot compute that.", "stop"), True),
        ("irrelevance_0", response([], None, "stop"), True),
        (
            "irrelevance_0",
            response([("determine_body_mass_index", '{"weight":10,"height":5}')]),
            "irrelevance_error",
        ),
    ]
    replies = [reply_to(case_id, body) for case_id, body, _ in known]
    sent = [{"id": r.case_id, "category": r.category, "result": r.result} for r in replies]
    out = tmp_path / "out.json"
    with FileLock(str(cache_dir() / "bfcl-eval.lock")):
        python = bfcl_python(cache_dir())
    subprocess.run(
        [str(python), "-P", "-c", DRIVER, str(BENCH), str(out)],
        input=json.dumps(sent),
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.read_text())

    cases = {c["id"]: c for c in result["cases"]}
    assert sorted(cases) == [
        "irrelevance_0",
        "irrelevance_1",
        "parallel_0",
        "parallel_1",
        "simple_python_0",
        "simple_python_1",
    ]
    body = request_body(cases["simple_python_1"], "m", max_tokens=64)
    assert body["messages"][0]["role"] == "user" and "factorial" in body["messages"][0]["content"]
    (tool,) = body["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == "math_factorial"
    assert tool["function"]["parameters"]["type"] == "object"  # BFCL's "dict"
    assert tool["function"]["description"].endswith(
        "Note that the provided function is in Python 3 syntax."
    )
    bmi = cases["irrelevance_0"]["tools"][0]["function"]["parameters"]["properties"]
    assert bmi["weight"]["type"] == "number"  # BFCL's "float"

    for (case_id, _, expected), verdict in zip(known, result["verdicts"], strict=True):
        assert verdict["id"] == case_id
        if expected is True:
            assert verdict["valid"], verdict
        else:
            assert not verdict["valid"] and verdict["error_type"].startswith(expected), verdict


def test_runs_are_kept_and_reused_only_for_the_same_cases(tmp_path: Path) -> None:
    """A --runs file round-trips every reply; a saved category is reused for the same server
    and the very same cases, and runs neither reused nor redone stay in the file."""
    body = response([("math_factorial", '{"number":5}')])
    answered = reply_to("simple_python_1", body)
    failed = Reply("kvchat", "simple_python_2", "simple_python", frozenset({"f"}))
    failed.error, failed.error_type = "HTTP 500: boom", "http_error"
    kept = CategoryRun("kvchat", "simple_python", [answered, failed], 12.5, "2026-12-07 21:00 UTC")
    other = CategoryRun("llama-server", "irrelevance", [], 3.0, "2026-12-07 22:00 UTC")
    path = tmp_path / "runs.json"
    assert load_runs(path) == []
    save_runs(path, [kept, other])
    saved = load_runs(path)
    assert saved == [kept, other] and saved[0].replies[0].offered == answered.offered
    assert saved[0].replies[0].result == answered.result
    cases = [{"id": "simple_python_1"}, {"id": "simple_python_2"}]
    assert reusable(saved, "kvchat", "simple_python", cases) == kept
    assert reusable(saved, "llama-server", "simple_python", cases) is None
    assert reusable(saved, "kvchat", "simple_python", cases[:1]) is None  # other cases
    assert unused(saved, [kept]) == [other]
