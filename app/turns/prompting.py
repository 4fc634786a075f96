"""From an API request to what the engine takes: messages checked and turned into chat
messages (tool sequences as OpenAI requires them), tools checked and offered to the template,
sampling parameters, and replies the model generated spliced back as their exact ids."""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvchat.app.errors import invalid_request
from kvchat.app.schemas.chat import Message, NamedToolChoice, SamplingFields, Tool
from kvchat.app.turns.structured import check_json_schema
from kvchat.inference import ChatMessage, Grammar, SamplingParams

SESSION_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Engine sessions of X-Session-Id, prompt_cache_key and openings (conversations': conv_).
STATELESS_SESSION_PREFIX = "sess_"


# -- tools -----------------------------------------------------------------------------------------


def offered_tools(fields: SamplingFields) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt (None when none are offered), after checking the
    tools, tool_choice and response_format the request gives."""
    tools = fields.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid_request("tools: function names must be unique", "tools")
    for i, tool in enumerate(tools):
        check_parameters_schema(tool, f"tools.{i}.function.parameters")
    choice = fields.tool_choice
    if choice is not None and not tools and choice != "none":
        raise invalid_request("tool_choice is only allowed when tools are specified", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid_request(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            "tool_choice",
        )
    if not tools or choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def check_parameters_schema(tool: Tool, param: str) -> None:
    schema = tool.function.parameters
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise invalid_request(
            "a function's parameters must be a JSON schema of type 'object'", param
        )
    check_json_schema(schema, param)


# -- messages --------------------------------------------------------------------------------------


def chat_messages(
    messages: Sequence[Message],
    tool_names: set[str] | None,
    generated: GeneratedIds | None = None,
    session_key: str | None = None,
) -> list[ChatMessage]:
    """API messages -> chat messages, with OpenAI's rules for tool sequences: a tool message
    answers a call of the assistant message right before it (or before its sibling results);
    calls in the history name offered tools (when tools are given). Assistant replies this
    server generated for the session are spliced back as their exact ids."""
    out: list[ChatMessage] = []
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        text = m.text
        if m.role == "tool":
            if m.tool_call_id is None:
                raise invalid_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
            if m.tool_call_id not in open_calls:
                raise invalid_request(
                    "messages with role 'tool' must be a response to a preceding message with "
                    "'tool_calls'",
                    f"{where}.tool_call_id",
                )
            open_calls.discard(m.tool_call_id)
            if text is None:
                raise invalid_request("a tool message needs content", f"{where}.content")
            out.append(ChatMessage("tool", text, tool_call_id=m.tool_call_id, name=m.name))
            continue
        if open_calls:  # a tool message was handled above
            raise invalid_request(
                "an assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id' (missing: {', '.join(sorted(open_calls))})",
                where,
            )
        if m.role == "assistant":
            calls = m.tool_calls or []
            for j, call in enumerate(calls):
                if tool_names is not None and call.function.name not in tool_names:
                    raise invalid_request(
                        f"the assistant message calls {call.function.name!r}, which is not "
                        "in tools",
                        f"{where}.tool_calls.{j}.function.name",
                    )
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise invalid_request(
                        f"tool call arguments must be a JSON object: {e.msg}",
                        f"{where}.tool_calls.{j}.function.arguments",
                    ) from e
                if not isinstance(arguments, dict):
                    raise invalid_request(
                        "tool call arguments must be a JSON object",
                        f"{where}.tool_calls.{j}.function.arguments",
                    )
            ids = [c.id for c in calls]
            if len(set(ids)) != len(ids):
                raise invalid_request("tool call ids must be unique", f"{where}.tool_calls")
            open_calls = set(ids)
            if text is None and not calls:
                raise invalid_request(
                    "an assistant message needs content or tool_calls", f"{where}.content"
                )
            spliced = (
                generated.lookup(session_key, text, calls) if generated and session_key else None
            )
            if spliced is not None:  # its calls go along (not rendered: they are in the ids)
                out.append(
                    ChatMessage(
                        "assistant",
                        None,
                        token_ids=spliced,
                        tool_calls=tuple(c.model_dump() for c in calls) or None,
                    )
                )
            else:
                out.append(
                    ChatMessage(
                        "assistant",
                        text,
                        name=m.name,
                        tool_calls=tuple(c.model_dump() for c in calls) or None,
                    )
                )
            continue
        if text is None:
            raise invalid_request(f"a {m.role} message needs content", f"{where}.content")
        role = "system" if m.role == "developer" else m.role
        out.append(ChatMessage(role, text, name=m.name))
    return out


def sampling_params(
    fields: SamplingFields,
    *,
    max_tokens: int | None,
    seed_offset: int = 0,
    grammar: Grammar | None = None,
) -> SamplingParams:
    stop = fields.stop
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=fields.top_k or None,
        min_p=fields.min_p or 0.0,
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        repetition_penalty=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
        logit_bias=tuple((int(t), b) for t, b in (fields.logit_bias or {}).items()),
        seed=fields.choice_seed(seed_offset),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logprobs=fields.logprobs,
        top_logprobs=fields.top_logprobs or 0,
        ignore_eos=fields.ignore_eos,
        grammar=grammar,
    )


# -- replies generated for a stateless session -----------------------------------------------------


class GeneratedIds:
    """The exact ids of recent replies, per session: an agent that resends its whole history
    gets its assistant messages spliced back token for token, so the pinned KV matches
    (re-tokenizing the text could differ from what the model generated)."""

    def __init__(self, max_sessions: int = 4096, per_session: int = 64) -> None:
        self.max_sessions = max_sessions
        self.per_session = per_session
        self._sessions: OrderedDict[str, OrderedDict[str, tuple[int, ...]]] = OrderedDict()

    @staticmethod
    def _key(content: str | None, calls: Sequence[Any]) -> str:
        def fields(call: Any) -> list[str]:
            if isinstance(call, dict):
                function = call.get("function", {})
                return [call.get("id", ""), function.get("name", ""), function.get("arguments", "")]
            return [call.id, call.function.name, call.function.arguments]

        return json.dumps([content or "", [fields(c) for c in calls]], ensure_ascii=False)

    def remember(
        self, session_key: str, content: str | None, calls: Sequence[Any], token_ids: Sequence[int]
    ) -> None:
        replies = self._sessions.setdefault(session_key, OrderedDict())
        self._sessions.move_to_end(session_key)
        replies[self._key(content, calls)] = tuple(token_ids)
        while len(replies) > self.per_session:
            replies.popitem(last=False)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def lookup(
        self, session_key: str, content: str | None, calls: Sequence[Any]
    ) -> tuple[int, ...] | None:
        replies = self._sessions.get(session_key)
        if replies is None:
            return None
        return replies.get(self._key(content, calls))


def spliced(
    messages: Sequence[ChatMessage], generated: GeneratedIds, session_key: str
) -> list[ChatMessage]:
    """`messages` with each assistant message this server generated for the session (and
    still remembers) as its exact ids; the others as they are."""
    out = []
    for m in messages:
        ids = (
            generated.lookup(session_key, m.content, m.tool_calls or ())
            if m.role == "assistant" and m.token_ids is None
            else None
        )
        out.append(m if ids is None else replace(m, content=None, token_ids=ids))
    return out


def session_key(owner: str, session_id: str | None) -> str | None:
    """The engine session of a stateless call's X-Session-Id, scoped to the key's owner:
    `sess_` and the first 32 hex digits of sha256(owner, NUL, X-Session-Id). It is also the
    session's id in the admin API (`/v1/admin/sessions/{id}`, `GET /v1/admin/memory`): the
    header a client sent never shows there, and two owners' equal headers are two sessions."""
    if session_id is None:
        return None
    if not SESSION_ID_PATTERN.match(session_id):
        raise invalid_request(
            "X-Session-Id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
            "X-Session-Id",
        )
    digest = hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()
    return f"{STATELESS_SESSION_PREFIX}{digest[:32]}"


def prompt_cache_session_key(owner: str, prompt_cache_key: str | None) -> str | None:
    """The engine session of a stateless call's `prompt_cache_key` (OpenAI's name for the
    requests that share a prefix; Codex sends its conversation's id) when it gives no
    X-Session-Id, scoped to the key's owner: `sess_` and the first 32 hex digits of
    sha256(owner, NUL, SOH, prompt_cache_key): never an X-Session-Id's session (a header has
    no control characters) nor an opening's (a NUL follows the owner's NUL there). It is the
    session's id in the admin API, as session_key's, and two owners' equal keys are two
    sessions. An empty key names none (None)."""
    if not prompt_cache_key:
        return None
    digest = hashlib.sha256(f"{owner}\0\x01{prompt_cache_key}".encode()).hexdigest()
    return f"{STATELESS_SESSION_PREFIX}{digest[:32]}"


OPENING_ROLES = ("system", "developer")  # a first message of these: the opening takes two


def opening(messages: Sequence[Message]) -> list[str] | None:
    """What names a conversation whose client sends no session key and resends its history
    each call: the text of its first message, and of the second too when the first is a
    system (or developer) message (a system prompt shared by many conversations names none of
    them). The same on every call of the conversation, since the history only grows; the rule
    HAProxy's routing key for such calls follows (app/fleet/haproxy.cfg.j2). None when there
    is no such text (a first message of tool calls only)."""
    count = 2 if messages and messages[0].role in OPENING_ROLES else 1
    texts = [m.text for m in messages[:count]]
    if len(texts) < count or any(t is None for t in texts):
        return None
    return [t for t in texts if t is not None]


def opening_session_key(owner: str, messages: Sequence[Message]) -> str | None:
    """The engine session of a keyless stateless call (KVCHAT_KEYLESS_SESSIONS): `sess_` and
    32 hex digits of sha256(owner, NUL, NUL, the opening's texts each after a NUL): never an
    X-Session-Id's key (a header has no NUL). Conversations that open alike share a session:
    harmless, since the engine reuses a session's KV only as far as the token ids match."""
    texts = opening(messages)
    if texts is None:
        return None
    digest = hashlib.sha256("\0".join([owner, "", *texts]).encode()).hexdigest()
    return f"{STATELESS_SESSION_PREFIX}{digest[:32]}"
