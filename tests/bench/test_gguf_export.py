"""bench/gguf_export.py runs llama.cpp's converter as a script of its own folder: it imports the
modules beside it (`conversion/`, `gguf-py/`), under the Makefile's PYTHONSAFEPATH too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvchat.bench.gguf_export import convert

# A stand-in converter with the real one's layout and argv: it imports a package of its own
# folder and one from gguf-py/, and writes what they return to --outfile.
SCRIPT = """\
import argparse
from conversion import name
from gguf_side import version
ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--outtype")
ap.add_argument("--outfile")
a = ap.parse_args()
open(a.outfile, "w").write(f"{name} {version} {a.outtype} {a.model}")
"""


def converter_folder(root: Path) -> Path:
    (root / "conversion").mkdir(parents=True)
    (root / "conversion" / "__init__.py").write_text("name = 'conversion'\n")
    (root / "gguf-py" / "gguf_side").mkdir(parents=True)
    (root / "gguf-py" / "gguf_side" / "__init__.py").write_text("version = 'gguf-py'\n")
    (root / "convert_hf_to_gguf.py").write_text(SCRIPT)
    return root


def test_the_converter_imports_its_own_folder_under_a_safe_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    converter = converter_folder(tmp_path / "converter")
    out = convert(
        tmp_path / "model", tmp_path / "model-bf16.gguf", "bf16", converter, Path(sys.executable)
    )
    assert out.read_text() == f"conversion gguf-py bf16 {tmp_path / 'model'}"
    assert not out.with_suffix(".partial").exists()


def test_an_existing_file_is_not_converted_again(tmp_path: Path) -> None:
    out = tmp_path / "model-f16.gguf"
    out.write_text("kept")
    assert convert(tmp_path / "model", out, "f16", tmp_path / "no-converter") == out
    assert out.read_text() == "kept"
