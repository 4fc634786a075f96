"""Model execution: tokenizers, chat templates, the model and the engine that runs it.

This is the package's face: other packages import from here, never from its modules. Each
name loads on first use (PEP 562 `__getattr__`), from the one module that defines it, so a
name costs what its module costs: `from kvchat.inference import ChatMessage, SamplingParams` imports
no torch, while `Engine` or `AsyncEngine` brings in the model, torch and the kernels. The
imports under TYPE_CHECKING are the same names, for the type checker; a test keeps the two
lists equal (tests/app/test_package_faces.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine.async_engine import AsyncEngine
    from .engine.checks import CheckedRequest
    from .engine.config import DTYPES, EngineConfig
    from .engine.engine import Engine
    from .engine.priority import PRIORITY_LOW, PRIORITY_NORMAL
    from .engine.reports import (
        EngineStats,
        KVSlotUsage,
        MemoryReport,
        SessionEviction,
        SessionInfo,
    )
    from .engine.request_output import RequestOutput
    from .engine.scheduler import SchedulerConfig
    from .errors import (
        EngineDeadError,
        GGUFImportError,
        InvalidRequestError,
        ModelLoadError,
        RequestFailedError,
    )
    from .model.config import ModelConfig
    from .model.dev_model import PRESETS, init_model
    from .model.gguf_import import import_gguf
    from .model.gguf_presets import GGUF_PRESETS, fetch_preset_gguf, init_gguf_preset
    from .model.linear_plan import cpu_description
    from .model.linear_plan_cache import default_plan_dir
    from .model.sampling_params import SamplingParams
    from .structured.compiler import GrammarCompiler, GrammarError
    from .structured.grammar import (
        ANY_OBJECT,
        Grammar,
        ToolSpec,
        generic_answer_grammar,
        json_object_grammar,
        json_schema_grammar,
        tool_call_grammar,
    )
    from .text.chat_template import ChatMessage, ChatTemplate, ChatTemplateError, load_chat_template
    from .text.context_builder import ContextBuilder, MessageCounts, history_message
    from .text.generic_tool_calls import GENERIC
    from .text.loops import ends_in_loop
    from .text.reply_ids import ids_without_spans
    from .text.tokenizer import Tokenizer, TokenizerError
    from .text.tokenizer_files import load_tokenizer
    from .text.tool_calls import (
        ContentDelta,
        ToolCall,
        ToolCallDelta,
        ToolCallStreamParser,
        call_key,
        parse_tool_calls,
    )
    from .text.turn_planner import NEW, TurnPlan, branch_key, plan_turn, prompt_key

# name -> the module (in this package) that defines it
_MODULE_OF = {
    "AsyncEngine": "engine.async_engine",
    **dict.fromkeys(
        ("ChatMessage", "ChatTemplate", "ChatTemplateError", "load_chat_template"),
        "text.chat_template",
    ),
    **dict.fromkeys(("ContextBuilder", "MessageCounts", "history_message"), "text.context_builder"),
    **dict.fromkeys(("PRESETS", "init_model"), "model.dev_model"),
    "Engine": "engine.engine",
    **dict.fromkeys(("DTYPES", "EngineConfig"), "engine.config"),
    **dict.fromkeys(
        ("EngineStats", "KVSlotUsage", "MemoryReport", "SessionEviction", "SessionInfo"),
        "engine.reports",
    ),
    **dict.fromkeys(
        (
            "EngineDeadError",
            "GGUFImportError",
            "InvalidRequestError",
            "ModelLoadError",
            "RequestFailedError",
        ),
        "errors",
    ),
    "import_gguf": "model.gguf_import",
    **dict.fromkeys(
        ("GGUF_PRESETS", "fetch_preset_gguf", "init_gguf_preset"), "model.gguf_presets"
    ),
    **dict.fromkeys(
        (
            "ANY_OBJECT",
            "Grammar",
            "ToolSpec",
            "generic_answer_grammar",
            "json_object_grammar",
            "json_schema_grammar",
            "tool_call_grammar",
        ),
        "structured.grammar",
    ),
    **dict.fromkeys(("GrammarCompiler", "GrammarError"), "structured.compiler"),
    "cpu_description": "model.linear_plan",
    "default_plan_dir": "model.linear_plan_cache",
    "ModelConfig": "model.config",
    **dict.fromkeys(("PRIORITY_LOW", "PRIORITY_NORMAL"), "engine.priority"),
    "CheckedRequest": "engine.checks",
    "RequestOutput": "engine.request_output",
    "SamplingParams": "model.sampling_params",
    "SchedulerConfig": "engine.scheduler",
    **dict.fromkeys(("Tokenizer", "TokenizerError"), "text.tokenizer"),
    "load_tokenizer": "text.tokenizer_files",
    "GENERIC": "text.generic_tool_calls",
    "ends_in_loop": "text.loops",
    "ids_without_spans": "text.reply_ids",
    **dict.fromkeys(
        (
            "ContentDelta",
            "ToolCall",
            "ToolCallDelta",
            "ToolCallStreamParser",
            "call_key",
            "parse_tool_calls",
        ),
        "text.tool_calls",
    ),
    **dict.fromkeys(
        ("NEW", "TurnPlan", "branch_key", "plan_turn", "prompt_key"), "text.turn_planner"
    ),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
