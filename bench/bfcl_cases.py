"""BFCL's side of bench/tool_calls.py: the Berkeley Function Calling Leaderboard's test cases as
OpenAI Chat Completions requests, and its own verdicts on the replies. It runs in bfcl-eval's
venv (bench/tool_calls.py builds it under models/.peers and runs this file there) and imports
nothing of kvchat, so that venv needs no kvchat and kvchat's needs no bfcl-eval:

    models/.peers/bfcl-eval-2026.3.23/bin/python bench/bfcl_cases.py cases --out cases.json \\
        --categories simple_python,irrelevance --limit 5
    models/.peers/bfcl-eval-2026.3.23/bin/python bench/bfcl_cases.py score \\
        --replies replies.json --out verdicts.json

bfcl-eval's own generator (`bfcl generate`) can reach an OpenAI-compatible server only as one of
its registered models (OPENAI_BASE_URL with, say, `gpt-4o-...-FC`): that sends the registered
model's name, temperature 0.001, no max_tokens and `store`, and leaves no per-request timing or
malformed-call count. So the bench sends the requests itself and takes from bfcl-eval exactly
what its generator and checker do for an OpenAI function-calling model (OpenAICompletionsHandler):

- cases: `bfcl_eval.utils.load_dataset_entry(category)` (with its language hint, as generation
  loads them); the messages are the entry's first turn as they are (FC mode adds no system
  prompt); the tools are `convert_to_tool(functions, GORILLA_TO_OPENAPI,
  ModelStyle.OPENAI_COMPLETIONS)` (BFCL's type names mapped to JSON Schema, `.` in function
  names replaced by `_`);
- verdicts: the reply recorded as the handler records it (`[{name: arguments}, ...]` for tool
  calls, else the content), then eval_runner's per-entry functions, the ones `bfcl evaluate` runs:
  `_evaluate_single_ast_entry` (the handler's `decode_ast`, the format check, `ast_checker`)
  and, for irrelevance, `_evaluate_single_relevance_entry`; under a model registered as
  function-calling with `underscore_to_dot`, so the checker compares `math_hypot` with
  `math.hypot` as it does for OpenAI's models.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

# The non-live single-turn Python categories, as bfcl-eval names them.
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
# The name the checker looks the model up by (it maps "_" to "/", so none in it).
MODEL_NAME = "kvchat-bench-FC"


def model_result(tool_calls: list[dict[str, str]] | None, content: str | None) -> Any:
    """A reply as bfcl-eval's OpenAICompletionsHandler records it: `[{name: arguments}, ...]`
    (arguments as the JSON text the server sent) when the message has `tool_calls` (an empty
    list included), else its content (None included)."""
    if tool_calls is not None:
        return [{call["name"]: call["arguments"]} for call in tool_calls]
    return content


def load_cases(categories: list[str], limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` cases of each category (all when None) as
    {id, category, messages, tools}: what bfcl-eval's generator sends an OpenAI FC model."""
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import load_dataset_entry

    cases = []
    for category in categories:
        _check_category(category)
        for entry in load_dataset_entry(category)[:limit]:
            cases.append(
                {
                    "id": entry["id"],
                    "category": category,
                    "messages": entry["question"][0],
                    "tools": convert_to_tool(
                        entry["function"], GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS
                    ),
                }
            )
    return cases


def ground_truth(category: str) -> dict[str, list[dict[str, Any]]]:
    """The possible answers of a category by case id ({} for irrelevance, which has none)."""
    _check_category(category)
    if category == "irrelevance":
        return {}
    from bfcl_eval.utils import load_ground_truth_entry

    return {e["id"]: e["ground_truth"] for e in load_ground_truth_entry(category)}


def score(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL's verdict on each reply {id, category, result} (`result` as model_result makes it):
    {id, valid, error_type, error}, error_type and error None when valid."""
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.eval_checker.eval_runner import (
        _evaluate_single_ast_entry,
        _evaluate_single_relevance_entry,
    )

    handler = _handler()
    verdicts = []
    for reply in replies:
        category, case_id = reply["category"], reply["id"]
        prompt = _prompts(category)[case_id]
        if category == "irrelevance":
            out = _evaluate_single_relevance_entry(
                handler, case_id, reply["result"], prompt, MODEL_NAME, category
            )
        else:
            out = _evaluate_single_ast_entry(
                handler,
                case_id,
                reply["result"],
                ground_truth(category)[case_id],
                prompt,
                MODEL_NAME,
                category,
                language=Language.PYTHON,
                return_format=ReturnFormat.PYTHON,
            )
        valid = bool(out["valid"])
        verdicts.append(
            {
                "id": case_id,
                "valid": valid,
                "error_type": None if valid else out.get("error_type"),
                "error": None if valid else "; ".join(str(e) for e in out.get("error", [])),
            }
        )
    return verdicts


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")


@cache
def _prompts(category: str) -> dict[str, dict[str, Any]]:
    """The entries as the evaluator loads them (no language hint), by id."""
    from bfcl_eval.utils import load_dataset_entry

    entries = load_dataset_entry(
        category, include_prereq=False, include_language_specific_hint=False
    )
    return {e["id"]: e for e in entries}


@cache
def _handler() -> Any:
    """bfcl-eval's OpenAI Chat Completions handler in FC mode, registered under MODEL_NAME; only
    its decode_ast runs (its OpenAI client is built, never called)."""
    from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
    from bfcl_eval.model_handler.api_inference.openai_completion import (
        OpenAICompletionsHandler,
    )

    MODEL_CONFIG_MAPPING.setdefault(
        MODEL_NAME,
        ModelConfig(
            model_name=MODEL_NAME,
            display_name="kvchat bench (FC)",
            url="",
            org="",
            license="",
            model_handler=OpenAICompletionsHandler,
            is_fc_model=True,
            underscore_to_dot=True,
        ),
    )
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # the client refuses to build without
    return OpenAICompletionsHandler(
        model_name=MODEL_NAME, temperature=0, registry_name=MODEL_NAME, is_fc_model=True
    )


def main() -> int:
    ap = argparse.ArgumentParser(description="BFCL cases as OpenAI requests; BFCL's verdicts.")
    sub = ap.add_subparsers(dest="command", required=True)
    cases = sub.add_parser("cases", help="write the cases as JSON")
    cases.add_argument("--categories", default=",".join(CATEGORIES))
    cases.add_argument("--limit", type=int, default=None, help="cases per category")
    cases.add_argument("--out", type=Path, required=True)
    scoring = sub.add_parser("score", help="write BFCL's verdicts on replies as JSON")
    scoring.add_argument("--replies", type=Path, required=True)
    scoring.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # bfcl-eval makes its result and score folders on import, beside the package unless told
    with tempfile.TemporaryDirectory(prefix="bfcl-") as root:
        os.environ.setdefault("BFCL_PROJECT_ROOT", root)
        if args.command == "cases":
            out: Any = load_cases([c for c in args.categories.split(",") if c], args.limit)
        else:
            out = score(json.loads(args.replies.read_text()))
        args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
