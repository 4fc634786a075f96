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
    from .async_engine import AsyncEngine
    from .chat_template import ChatMessage, ChatTemplate, ChatTemplateError, load_chat_template
    from .context_builder import ContextBuilder, MessageCounts, history_message
    from .dev_model import PRESETS, init_model
    from .engine import Engine
    from .engine_config import DTYPES, EngineConfig
    from .engine_reports import (
        EngineStats,
        KVSlotUsage,
        MemoryReport,
        SessionEviction,
        SessionInfo,
    )
    from .errors import (
        EngineDeadError,
        GGUFImportError,
        InvalidRequestError,
        ModelLoadError,
        RequestFailedError,
    )
    from .gguf_import import import_gguf
    from .gguf_presets import GGUF_PRESETS, fetch_preset_gguf, init_gguf_preset
    from .grammar import (
        ANY_OBJECT,
        Grammar,
        ToolSpec,
        json_object_grammar,
        json_schema_grammar,
        tool_call_grammar,
    )
    from .grammar_compiler import GrammarCompiler, GrammarError
    from .linear_plan import cpu_description
    from .linear_plan_cache import default_plan_dir
    from .model_config import ModelConfig
    from .priority import PRIORITY_LOW, PRIORITY_NORMAL
    from .request_checks import CheckedRequest
    from .request_output import RequestOutput
    from .sampling_params import SamplingParams
    from .scheduler import SchedulerConfig
    from .tokenizer import Tokenizer, TokenizerError
    from .tokenizer_files import load_tokenizer
    from .tool_calls import (
        ContentDelta,
        ToolCall,
        ToolCallDelta,
        ToolCallStreamParser,
        parse_tool_calls,
    )
    from .turn_planner import NEW, TurnPlan, branch_key, plan_turn, prompt_key

# name -> the module (in this package) that defines it
_MODULE_OF = {
    "AsyncEngine": "async_engine",
    **dict.fromkeys(
        ("ChatMessage", "ChatTemplate", "ChatTemplateError", "load_chat_template"),
        "chat_template",
    ),
    **dict.fromkeys(("ContextBuilder", "MessageCounts", "history_message"), "context_builder"),
    **dict.fromkeys(("PRESETS", "init_model"), "dev_model"),
    "Engine": "engine",
    **dict.fromkeys(("DTYPES", "EngineConfig"), "engine_config"),
    **dict.fromkeys(
        ("EngineStats", "KVSlotUsage", "MemoryReport", "SessionEviction", "SessionInfo"),
        "engine_reports",
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
    "import_gguf": "gguf_import",
    **dict.fromkeys(("GGUF_PRESETS", "fetch_preset_gguf", "init_gguf_preset"), "gguf_presets"),
    **dict.fromkeys(
        (
            "ANY_OBJECT",
            "Grammar",
            "ToolSpec",
            "json_object_grammar",
            "json_schema_grammar",
            "tool_call_grammar",
        ),
        "grammar",
    ),
    **dict.fromkeys(("GrammarCompiler", "GrammarError"), "grammar_compiler"),
    "cpu_description": "linear_plan",
    "default_plan_dir": "linear_plan_cache",
    "ModelConfig": "model_config",
    **dict.fromkeys(("PRIORITY_LOW", "PRIORITY_NORMAL"), "priority"),
    "CheckedRequest": "request_checks",
    "RequestOutput": "request_output",
    "SamplingParams": "sampling_params",
    "SchedulerConfig": "scheduler",
    **dict.fromkeys(("Tokenizer", "TokenizerError"), "tokenizer"),
    "load_tokenizer": "tokenizer_files",
    **dict.fromkeys(
        ("ContentDelta", "ToolCall", "ToolCallDelta", "ToolCallStreamParser", "parse_tool_calls"),
        "tool_calls",
    ),
    **dict.fromkeys(("NEW", "TurnPlan", "branch_key", "plan_turn", "prompt_key"), "turn_planner"),
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
