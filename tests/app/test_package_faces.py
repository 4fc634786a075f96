"""The service reaches `inference`, `memory` and `history` through their faces (their
`__init__`) only, and the faces cost what they should: `memory`, `history` and the light names
of `inference` import no torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat import history, inference, memory

ROOT = Path(__file__).resolve().parents[2]
FACES = {"inference": inference, "memory": memory, "history": history}
ENGINE_PACKAGES = ("inference", "memory", "kernels", "history")


def app_imports() -> list[tuple[str, int, str, tuple[str, ...]]]:
    """(file, line, module, names) of every import in app/ (names empty for `import x`)."""
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = str(path.relative_to(ROOT))
            if isinstance(node, ast.Import):
                found += [(where, node.lineno, alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = tuple(alias.name for alias in node.names)
                found.append((where, node.lineno, node.module, names))
    return found


def test_app_imports_only_the_faces_of_the_engine_packages() -> None:
    wrong = []
    for where, line, module, names in app_imports():
        parts = module.split(".")
        if parts[0] != "kvchat" or len(parts) < 2 or parts[1] not in ENGINE_PACKAGES:
            continue
        package = parts[1]
        if module != f"kvchat.{package}" or package not in FACES:
            wrong.append(f"{where}:{line}: import of {module} (use the face of {package})")
            continue
        face = FACES[package].__all__
        wrong += [
            f"{where}:{line}: {package}.{name} is not on the face of {package}"
            for name in names
            if name not in face
        ]
    assert wrong == []


def test_the_scan_sees_the_service_importing_the_engine() -> None:
    """The scan above reads the real imports (an empty scan would pass anything)."""
    modules = {(where, module) for where, _, module, _ in app_imports()}
    assert ("app/runtime.py", "kvchat.inference") in modules
    assert ("app/settings.py", "kvchat.memory") in modules
    assert ("app/session_settings.py", "kvchat.history") in modules


def type_checking_names(path: Path) -> set[str]:
    """The names a face imports under `if TYPE_CHECKING:` (what the type checker sees)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                names.update(alias.name for alias in stmt.names)
    return names


def test_the_lazy_face_of_inference_names_what_the_type_checker_sees() -> None:
    declared = type_checking_names(ROOT / "inference" / "__init__.py")
    assert declared == set(inference.__all__)
    for name in inference.__all__:
        module = importlib.import_module(f"kvchat.inference.{inference._MODULE_OF[name]}")
        assert getattr(inference, name) is getattr(module, name), name
    with pytest.raises(AttributeError):
        inference.Scheduler  # noqa: B018  (internal: not on the face)


@pytest.mark.parametrize("face", [memory, history], ids=["memory", "history"])
def test_every_name_on_a_face_is_defined_in_its_package(face: object) -> None:
    package = face.__name__  # type: ignore[attr-defined]
    for name in face.__all__:  # type: ignore[attr-defined]
        value = getattr(face, name)
        owner = getattr(value, "__module__", None)
        assert owner is None or owner.startswith(f"{package}."), (name, owner)


def modules_loaded_by(code: str) -> list[str]:
    probe = (
        f"import sys; {code}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton'}"
        " | {m for m in sys.modules} & {'kvchat.kernels'}))"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    loaded: list[str] = ast.literal_eval(proc.stdout.strip())
    return loaded


@pytest.mark.parametrize(
    "code",
    [
        "import kvchat.memory",
        "import kvchat.history",
        "from kvchat.memory import KV_CACHE_DTYPES, CacheConfig, SessionBudget",
        "from kvchat.history import plan_context, HistoryPolicy, summary_targets",
        "import kvchat.app.settings, kvchat.app.schemas.conversations",
        "from kvchat.inference import ChatMessage, SamplingParams, PRIORITY_LOW, EngineDeadError, "
        "RequestOutput, MessageCounts, Tokenizer, ToolCall, Grammar, InvalidRequestError",
    ],
)
def test_light_names_import_no_torch(code: str) -> None:
    assert modules_loaded_by(code) == []


def test_the_engine_names_do_bring_in_torch() -> None:
    """The probe above can see torch being imported."""
    assert "torch" in modules_loaded_by("from kvchat.inference import Engine")
