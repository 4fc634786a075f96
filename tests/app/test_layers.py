"""app/'s floors: every import in app/ (at module level, under TYPE_CHECKING or inside a
function alike) points down this list, never up it or sideways into a circle; the engine is
reached through the EngineClient only; a history policy is made from settings in one place."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app"

# Bottom to top: each unit (a package of app/, or a module at its top) may import only the
# units before it. A new unit must be placed here.
FLOORS = (
    "ranges",  # the integer ranges requests carry
    "session_settings",  # a session's budgets and history policy, declared once
    "store",  # SQLAlchemy tables and repositories
    "errors",  # the API's typed errors
    "settings",  # the one pydantic-settings class
    "schemas",  # request and response models
    "engine_client",  # the engine as the service sees it
    "coord",  # Redis or in-process coordination: locks, leases, events, limits' counters
    "ops",  # metrics, admission limits, the drain, background tasks, logs
    "runtime",  # the engine thread, tokenizer, templates, worker threads
    "turns",  # the turn service: lock -> plan -> engine -> store
    "deps",  # what the app holds, and the routes' FastAPI dependencies
    "transports",  # the protocols' logic: Chat Completions, Responses, WebSocket, admin
    "api",  # the routes
    "main",  # the app factory: the composition root
    "fleet",  # replicas behind HAProxy, as processes
    "cli",  # the `kvchat` command
)


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "kvchat." + ".".join(parts)


def unit_of(module: str) -> str:
    """kvchat.app.turns.service -> turns; kvchat.app.deps -> deps."""
    return module.split(".")[2]


def app_graph() -> dict[str, set[str]]:
    """module -> the app modules it imports."""
    modules = {module_of(p): p for p in APP.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            graph[module] |= {t for t in targets if t in modules and t != module}
    return graph


def test_every_unit_of_app_has_a_floor() -> None:
    units = {
        unit_of(module_of(p)) for p in APP.rglob("*.py") if p.parent != APP or p.stem != "__init__"
    }
    units.discard("app")
    assert units - set(FLOORS) == set(), "place the new unit in FLOORS"
    assert set(FLOORS) - units == set(), "a unit in FLOORS is gone"


def test_app_imports_point_down_its_floors() -> None:
    rank = {unit: i for i, unit in enumerate(FLOORS)}
    up = []
    for module, imported in sorted(app_graph().items()):
        if module == "kvchat.app":
            continue
        for target in sorted(imported):
            if target == "kvchat.app":
                continue
            here, there = unit_of(module), unit_of(target)
            if here != there and rank[there] > rank[here]:
                up.append(f"{module} imports {target} ({here} is below {there})")
    assert up == []


def test_app_has_no_import_circle() -> None:
    graph = app_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # A package's __init__ re-exporting its own modules is its face, not a circle.
    circles = [c for c in circles if not re.fullmatch(r"(kvchat\.app\.\w+) -> \1\.\w+ -> \1", c)]
    assert circles == []


def test_the_scan_sees_real_imports() -> None:
    """An empty scan would pass anything."""
    graph = app_graph()
    assert "kvchat.app.turns.pipeline" in graph["kvchat.app.turns.service"]
    assert "kvchat.app.engine_client" in graph["kvchat.app.runtime"]
    assert "kvchat.app.deps" in graph["kvchat.app.main"]


def test_only_the_engine_client_holds_the_engine() -> None:
    """The synchronous Engine and the AsyncEngine are the EngineClient implementation's: the
    rest of app/ names `engine_client`, never `.engine.` or `async_engine`."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        if path.name == "engine_client.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.engine\.|\basync_engine\b|\.engine\b(?!_)", line) and (
                "sqlalchemy" not in line
            ):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_a_history_policy_is_made_from_settings_in_one_place() -> None:
    sites = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(APP.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "HistoryPolicy(" in line
    ]
    assert len(sites) == 1 and sites[0].startswith("app/session_settings.py:"), sites
