"""kvchat's kernels import as `kvchat.kernels`, beside Hugging Face's PyPI package `kernels`
(which transformers' hub-kernels integration imports), in one process: from the repository
root, as every documented command runs (python -P), and from anywhere else."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Hugging Face's package is named "kernels": imported by name, so no line here reads as an
# import of the project's own old top-level package.
PROBE = """
import importlib
hub = importlib.import_module("kernels")
import transformers.integrations.hub_kernels
import kvchat.kernels
from kvchat.kernels import get_attention_ops
print(hub.__file__)
print(kvchat.kernels.__file__)
print(get_attention_ops.__module__)
"""


def test_both_kernels_packages_in_this_process() -> None:
    import transformers.integrations.hub_kernels  # noqa: F401

    import kvchat.kernels
    from kvchat.kernels import get_attention_ops

    hub = importlib.import_module("kernels")  # Hugging Face's
    assert not Path(str(hub.__file__)).resolve().is_relative_to(REPO / "kernels")
    assert Path(kvchat.kernels.__file__).resolve() == REPO / "kernels" / "__init__.py"
    assert get_attention_ops.__module__ == "kvchat.kernels.backend"


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_both_kernels_packages_in_a_new_process(where: str, tmp_path: Path) -> None:
    cwd = REPO if where == "root" else tmp_path
    proc = subprocess.run(
        [sys.executable, "-P", "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    hub, ours, module = proc.stdout.split()
    assert "site-packages" in hub and not Path(hub).resolve().is_relative_to(REPO / "kernels")
    assert Path(ours).resolve() == REPO / "kernels" / "__init__.py"
    assert module == "kvchat.kernels.backend"


def test_the_console_script_imports_the_namespace(tmp_path: Path) -> None:
    """The installed `kvchat` command, started outside the checkout, finds kvchat's kernels."""
    kvchat = Path(sys.executable).with_name("kvchat")
    proc = subprocess.run(
        [str(kvchat), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "serve" in proc.stdout and "init-model" in proc.stdout
