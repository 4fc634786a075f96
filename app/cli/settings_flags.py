"""Every field of the Settings class as a flag of a command (`kvchat serve`, and `kvchat fleet`
for its replicas), generated from the fields themselves: a new setting is a new flag.

A field `kv_cache_dtype` is the flag `--kv-cache-dtype`; its help is the field's description,
its metavar its type (INTEGER, FLOAT, PATH, TEXT, the choices of a Literal), a list is a
repeatable flag, and a boolean takes true or false (`--ws-compression true`). Defaults shown
are the class's, never the environment's, so a password in KVCHAT_DATABASE_URL is never echoed
by `--help`.

The flags reach Settings as init arguments, which pydantic-settings ranks above the environment
and .env; a flag not given leaves its setting to them. The flags pass text and Settings alone
validates it (each choice, range and type checked once, where it is declared), so a bad value
is one line naming the flag that carried it, or the variable when the environment did.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from rich.markup import escape

S = TypeVar("S", bound=BaseSettings)
R = TypeVar("R")

SCALAR_METAVARS: dict[type, str] = {int: "INTEGER", float: "FLOAT", str: "TEXT", Path: "PATH"}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    return f"{settings_cls.model_config.get('env_prefix', '')}{field}".upper()


def _without_none(annotation: Any) -> Any:
    """`int | None` -> int; anything else as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _option(settings_cls: type[BaseSettings], name: str) -> inspect.Parameter:
    """The typer option of one field: text in (Settings validates it), the field's default as
    the option's, shown in --help."""
    field = settings_cls.model_fields[name]
    kind = _without_none(field.annotation)
    help_text = escape(field.description or "")  # typer renders help as rich markup
    default = field.get_default(call_default_factory=True)
    if get_origin(kind) is list:
        (item,) = get_args(kind)
        option = typer.Option(
            flag_name(name),
            metavar=SCALAR_METAVARS.get(item, "TEXT"),
            help=f"{help_text} Repeat the flag for more than one.",
            show_default=bool(default),
        )
        return _keyword(name, list[str], option, [str(v) for v in default])
    if kind is bool:
        metavar = "[true|false]"
    elif get_origin(kind) is Literal:
        metavar = "[" + "|".join(str(a) for a in get_args(kind)) + "]"
    else:
        assert kind in SCALAR_METAVARS, f"Settings.{name}: no flag type for {kind!r}"
        metavar = SCALAR_METAVARS[kind]
    text = None if default is None else str(default).lower() if kind is bool else str(default)
    option = typer.Option(
        flag_name(name), metavar=metavar, help=help_text, show_default=text is not None
    )
    return _keyword(name, str | None, option, text)


def _keyword(name: str, annotation: Any, option: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation, option],
    )


def with_setting_flags(
    settings_cls: type[BaseSettings], exclude: Collection[str] = ()
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A typer command decorator: the command takes its own options and one flag per field of
    `settings_cls` (but `exclude`); it is called with its own and `flags`, the settings given on
    the command line ({field: text, or a list of text}); a setting whose flag was not given is
    left to the environment, .env and the class default."""
    names = [n for n in settings_cls.model_fields if n not in exclude]
    flags = [_option(settings_cls, n) for n in names]

    def decorate(command: Callable[..., R]) -> Callable[..., R]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "flags"]
        assert not {p.name for p in own} & set(names), "a command option shadows a setting"

        @functools.wraps(command)
        def run(context: typer.Context, **options: Any) -> R:
            given = {
                name: value
                for name in names
                if (value := options.pop(name)) is not None
                and _source(context, name) == "COMMANDLINE"
            }
            return command(**options, flags=given)

        context = inspect.Parameter(
            "context", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
        )
        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[context, *own, *flags]
        )
        return run

    return decorate


def _source(context: typer.Context, name: str) -> str | None:
    """Where an option's value came from: COMMANDLINE, DEFAULT, ... (click's ParameterSource)."""
    source = context.get_parameter_source(name)
    return None if source is None else source.name


def settings_from_flags(
    settings_cls: type[S], flags: Mapping[str, Any], fail: Callable[[str], NoReturn]
) -> S:
    """Settings from the flags (over the environment and .env); a value Settings refuses is one
    `fail` line naming its flag (or its variable, when the flag was not given)."""
    try:
        return settings_cls(**flags)
    except ValidationError as e:
        error = e.errors()[0]
        loc = error["loc"]
        field = str(loc[0]) if loc else None
        if field is None:
            source = "settings"
        elif field in flags:
            source = flag_name(field)
        else:
            source = env_name(settings_cls, field)
        got = f" (got {error['input']!r})" if loc and not isinstance(error["input"], dict) else ""
        message = error["msg"].removeprefix("Value error, ")
        fail(f"{source}: {message}{got}")


def as_environment(settings_cls: type[BaseSettings], flags: Mapping[str, Any]) -> dict[str, str]:
    """The flags as the variables another process's Settings reads (a fleet's replicas)."""

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, list):
            return json.dumps(value)  # pydantic-settings reads complex fields as JSON
        return str(value)

    return {env_name(settings_cls, name): text(value) for name, value in flags.items()}
