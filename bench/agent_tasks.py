"""The tasks of bench/agents.py: four function tools for an OpenAI Agents SDK agent (weather,
local time, unit conversion, population lookup), answering from fixed tables and logging every
call they execute; six tasks that need 2 to 6 of those calls; and the judging, from the calls
executed: a run is completed when every required (tool, key argument) was called and it ended
with a final output. A call the model wrote is malformed when it names no offered function or
its arguments are not a JSON object valid for the tool's schema."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents import RunContextWrapper, function_tool
from jsonschema import Draft202012Validator


def normalize(text: str) -> str:
    """Lower case, words split on white space (and a degree sign)."""
    return " ".join(text.lower().replace("°", " ").split())


# -- the tools -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A call a tool executed: its function's name and arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclass
class ToolLog:
    """The run's context: the calls its tools executed, in order."""

    executed: list[Call] = field(default_factory=list)


POPULATIONS = {
    "canada": "40.1 million",
    "japan": "124.5 million",
    "norway": "5.5 million",
    "cairo": "10.1 million",
    "lima": "10.9 million",
}
CONVERSIONS = {  # (from, to) -> f(value)
    ("celsius", "fahrenheit"): lambda v: v * 9 / 5 + 32,
    ("kilometers", "miles"): lambda v: v / 1.609344,
    ("miles", "kilometers"): lambda v: v * 1.609344,
}
UNIT_NAMES = {"c": "celsius", "f": "fahrenheit", "km": "kilometers", "mi": "miles"}


def _unit(text: str) -> str:
    word = normalize(text)
    word = UNIT_NAMES.get(word, word)
    return word if word.endswith("s") or word in ("celsius", "fahrenheit") else word + "s"


def _pick(text: str, choices: Sequence[str]) -> str:
    """A fixed choice per text (crc32: the same in every run)."""
    return choices[zlib.crc32(normalize(text).encode()) % len(choices)]


@function_tool
def get_weather(ctx: RunContextWrapper[ToolLog], city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. Paris.
    """
    ctx.context.executed.append(Call("get_weather", {"city": city}))
    sky = _pick(city[::-1], ("sunny", "light rain", "cloudy", "windy"))
    return f"{city}: {degrees(city)} C, {sky}"


def degrees(city: str) -> str:
    """The temperature get_weather gives for `city`."""
    return _pick(city, ("12", "18", "21", "26", "31"))


@function_tool
def get_time(ctx: RunContextWrapper[ToolLog], city: str) -> str:
    """Get the local time in a city.

    Args:
        city: The city's name, e.g. Paris.
    """
    ctx.context.executed.append(Call("get_time", {"city": city}))
    hours, minutes = _pick(city, ("08", "11", "14", "17", "22")), _pick(city[::-1], ("05", "30"))
    return f"{city}: {hours}:{minutes}"


@function_tool
def convert_units(
    ctx: RunContextWrapper[ToolLog], value: float, from_unit: str, to_unit: str
) -> str:
    """Convert a value from one unit to another (temperature, distance).

    Args:
        value: The number to convert.
        from_unit: The unit it is in, e.g. celsius.
        to_unit: The unit to convert it to, e.g. fahrenheit.
    """
    ctx.context.executed.append(
        Call("convert_units", {"value": value, "from_unit": from_unit, "to_unit": to_unit})
    )
    convert = CONVERSIONS.get((_unit(from_unit), _unit(to_unit)))
    if convert is None:
        return f"cannot convert {from_unit} to {to_unit}"
    return f"{value:g} {from_unit} = {convert(value):.1f} {to_unit}"


@function_tool
def lookup_population(ctx: RunContextWrapper[ToolLog], place: str) -> str:
    """Look up the population of a city or a country.

    Args:
        place: The city or country, e.g. France.
    """
    ctx.context.executed.append(Call("lookup_population", {"place": place}))
    return f"{place}: {POPULATIONS.get(normalize(place), 'unknown')}"


TOOLS = [get_weather, get_time, convert_units, lookup_population]
SCHEMAS: dict[str, dict[str, Any]] = {t.name: t.params_json_schema for t in TOOLS}


# -- the tasks and their judging -------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    """A call the task needs: `tool` with its `argument` naming one of `accepted` (as a whole
    word, case-insensitively: "Paris, France" names Paris)."""

    tool: str
    argument: str
    accepted: tuple[str, ...]

    def met_by(self, call: Call) -> bool:
        if call.name != self.tool:
            return False
        value = normalize(str(call.arguments.get(self.argument, "")))
        return any(re.search(rf"\b{re.escape(a)}\b", value) for a in self.accepted)

    def __str__(self) -> str:
        return f"{self.tool}({self.argument}={self.accepted[0]})"


@dataclass(frozen=True)
class AgentTask:
    name: str
    prompt: str
    shape: str  # how its calls depend on each other
    num_calls: int  # the fewest calls that do it
    required: tuple[Requirement, ...]

    def __post_init__(self) -> None:
        assert 0 < self.num_calls <= len(self.required), self


def _needs(tool: str, argument: str, *accepted: str) -> Requirement:
    return Requirement(tool, argument, accepted)


TASKS = (
    AgentTask(
        "weather_and_time",
        "What is the weather in Paris and the time in Tokyo?",
        "independent",
        2,
        (_needs("get_weather", "city", "paris"), _needs("get_time", "city", "tokyo")),
    ),
    AgentTask(
        "two_populations",
        "Look up the population of Canada and the population of Japan.",
        "independent",
        2,
        (
            _needs("lookup_population", "place", "canada"),
            _needs("lookup_population", "place", "japan"),
        ),
    ),
    AgentTask(
        "weather_then_convert",
        "Get the weather in Berlin, then convert its temperature from Celsius to Fahrenheit.",
        "chained",
        2,
        (
            _needs("get_weather", "city", "berlin"),
            _needs("convert_units", "from_unit", "celsius", "c"),
            _needs("convert_units", "value", degrees("Berlin")),  # from the weather's result
        ),
    ),
    AgentTask(
        "three_cities",
        "What is the weather in Rome, in Madrid and in Lisbon?",
        "independent",
        3,
        tuple(_needs("get_weather", "city", c) for c in ("rome", "madrid", "lisbon")),
    ),
    AgentTask(
        "trip_to_oslo",
        "I am flying to Oslo. Tell me the weather and the local time in Oslo, the population "
        "of Norway, and how many miles 300 kilometers is.",
        "independent",
        4,
        (
            _needs("get_weather", "city", "oslo"),
            _needs("get_time", "city", "oslo"),
            _needs("lookup_population", "place", "norway"),
            _needs("convert_units", "from_unit", "kilometers", "kilometer", "km"),
        ),
    ),
    AgentTask(
        "two_capitals",
        "For Cairo and for Lima, tell me the weather, the local time and the population.",
        "independent",
        6,
        tuple(
            _needs(tool, argument, city)
            for city in ("cairo", "lima")
            for tool, argument in (
                ("get_weather", "city"),
                ("get_time", "city"),
                ("lookup_population", "place"),
            )
        ),
    ),
)


def missing(task: AgentTask, executed: Sequence[Call]) -> list[Requirement]:
    """The task's required calls that no executed call meets."""
    return [r for r in task.required if not any(r.met_by(c) for c in executed)]


def judge(task: AgentTask, executed: Sequence[Call], final_output: object) -> bool:
    """Completed: every required call was executed and the run ended with a final output."""
    return final_output is not None and not missing(task, executed)


def malformed(name: str, arguments: str, schemas: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why a call the model wrote is malformed, or None when it is well formed: it names a
    function that was offered and its arguments are a JSON object valid for its schema."""
    schema = schemas.get(name)
    if schema is None:
        return f"names {name!r}, which was not offered"
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return "arguments are not JSON"
    if not isinstance(value, dict):
        return "arguments are not a JSON object"
    error = next(iter(Draft202012Validator(schema).iter_errors(value)), None)
    return None if error is None else f"arguments break the schema: {error.message}"
