"""LinearPlanCache: a measured linear plan is kept per machine and model shape, a restart with
the same key loads it instead of probing, another key probes again, and a file that cannot be
used is measured over and rewritten, never a failed start."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvchat.app.settings import Settings
from kvchat.inference.model import linear_plan_cache
from kvchat.inference.model.linear_plan import LinearPlan, measure_plan
from kvchat.inference.model.linear_plan_cache import (
    LinearPlanCache,
    default_plan_dir,
    load_or_measure,
    plan_for,
    plan_key,
)

CPU = torch.device("cpu")
machine_other_cpu_seconds = linear_plan_cache.other_cpu_seconds  # before quiet_machine patches
LAYER_SHAPES = [(96, 64), (64, 64), (256, 64), (64, 128)] * 2


class CountingProbe:
    """The real probe, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> LinearPlan:
        self.calls += 1
        return measure_plan(weights, dtype)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests run beside each other: in-process probes see a quiet machine (other
    processes' CPU time does not move), unless a test says otherwise."""
    monkeypatch.setattr(linear_plan_cache, "other_cpu_seconds", lambda: 0.0)


class BusyNeighbours:
    """Other processes' CPU seconds, advancing `cpus` seconds per second of the probe."""

    def __init__(self, cpus: float) -> None:
        self.cpus, self.start = cpus, time.perf_counter()

    def __call__(self) -> float:
        return self.cpus * (time.perf_counter() - self.start)


def layers(
    dtype: torch.dtype = torch.float32, shapes: Sequence[tuple[int, int]] = LAYER_SHAPES
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    return [torch.randn(n, k, generator=g).to(dtype) for n, k in shapes]


def paths(plan: LinearPlan) -> tuple[object, ...]:
    return (plan.dtype, plan.layout, plan.decode_paths, plan.prefill_path, plan.head_decode_paths)


def test_a_second_build_with_the_same_key_loads_the_plan_without_probing(tmp_path: Path) -> None:
    cache, probe = LinearPlanCache(tmp_path / "plans"), CountingProbe()
    weights = layers()
    first = load_or_measure(weights, torch.float32, cache, probe)
    assert probe.calls == 1 and not first.cached
    kept = Path(first.cache_file or "")
    assert kept.parent == tmp_path / "plans" and kept.name.startswith("float32-")
    assert os.listdir(kept.parent) == [kept.name]  # no temporary file left beside it
    record = json.loads(kept.read_text())
    assert record["key"] == plan_key([tuple(w.shape) for w in weights], torch.float32)
    assert record["key"]["shapes"] == [list(s) for s in LAYER_SHAPES]
    assert record["plan"]["decode_paths"] == first.as_dict()["decode_paths"]
    assert record["plan"]["cached"] is False and record["measure_seconds"] > 0
    written = kept.read_bytes()

    # The same shapes and dtype, other values (a restart loads the same model's weights).
    second = load_or_measure(layers(), torch.float32, cache, probe)
    assert probe.calls == 1
    assert second.cached and second.cache_file == str(kept)
    assert paths(second) == paths(first)
    assert second.probe_ms == {
        name: {rows: round(ms, 3) for rows, ms in by_rows.items()}
        for name, by_rows in first.probe_ms.items()
    }
    assert second.as_dict()["cached"] is True
    assert kept.read_bytes() == written


def test_a_plan_measured_beside_busy_processes_serves_its_run_and_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache, probe = LinearPlanCache(tmp_path / "plans"), CountingProbe()
    monkeypatch.setattr(linear_plan_cache, "other_cpu_seconds", BusyNeighbours(1.0))
    with caplog.at_level(logging.INFO, logger=linear_plan_cache.log.name):
        busy = load_or_measure(layers(), torch.float32, cache, probe)
    assert probe.calls == 1 and busy.cache_file is None and not busy.cached
    assert "kept 1.0 CPUs busy" in caplog.text
    assert not (tmp_path / "plans").exists() or list((tmp_path / "plans").iterdir()) == []
    assert "not kept" in caplog.text

    # The next start measures again; on a quiet machine its plan is kept.
    monkeypatch.setattr(linear_plan_cache, "other_cpu_seconds", BusyNeighbours(0.1))
    quiet = load_or_measure(layers(), torch.float32, cache, probe)
    assert probe.calls == 2 and quiet.cache_file is not None and quiet.reason == "measured"
    assert load_or_measure(layers(), torch.float32, cache, probe).cached and probe.calls == 2

    # An operator whose machine is never quiet raises the bar.
    tolerant = LinearPlanCache(tmp_path / "tolerant", busy_cpus=2.0)
    monkeypatch.setattr(linear_plan_cache, "other_cpu_seconds", BusyNeighbours(1.0))
    assert load_or_measure(layers(), torch.float32, tolerant, probe).cache_file is not None


def test_other_processes_cpu_time_is_read_from_the_machine() -> None:
    """A process beside this one spinning for a while shows in other_cpu_seconds; this
    process's own CPU time does not."""
    before = machine_other_cpu_seconds()
    spin = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass",
        ],
        timeout=60,
    )
    assert spin.returncode == 0
    after = machine_other_cpu_seconds()
    assert before is not None and after is not None and after - before >= 0.4


def test_another_dtype_or_shape_probes_again(tmp_path: Path) -> None:
    cache, probe = LinearPlanCache(tmp_path), CountingProbe()
    plans = [
        load_or_measure(layers(torch.float32), torch.float32, cache, probe),
        load_or_measure(layers(torch.bfloat16), torch.bfloat16, cache, probe),
        load_or_measure(layers(shapes=[*LAYER_SHAPES, (64, 256)]), torch.float32, cache, probe),
        load_or_measure(layers(shapes=LAYER_SHAPES[:-1]), torch.float32, cache, probe),
    ]
    assert probe.calls == 4 and not any(p.cached for p in plans)
    assert len({p.cache_file for p in plans}) == 4
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == [
        "bfloat16",
        "float32",
        "float32",
        "float32",
    ]
    again = load_or_measure(layers(torch.bfloat16), torch.bfloat16, cache, probe)
    assert probe.calls == 4 and again.cached and again.dtype == torch.bfloat16


def kept_plan_record(cache: LinearPlanCache) -> tuple[Path, dict[str, object]]:
    plan = load_or_measure(layers(), torch.float32, cache)
    assert plan.cache_file is not None
    return Path(plan.cache_file), json.loads(Path(plan.cache_file).read_text())


@pytest.mark.parametrize(
    "corrupt",
    ["empty", "truncated", "not utf-8", "not an object", "no plan", "unknown path", "bad rows"],
)
def test_an_unusable_cache_file_is_ignored_with_a_warning_and_replaced(
    corrupt: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = LinearPlanCache(tmp_path)
    path, record = kept_plan_record(cache)
    text = json.dumps(record)
    plan = dict(record["plan"])  # type: ignore[call-overload]
    damaged = {
        "empty": b"",
        "truncated": text[: len(text) // 2].encode(),
        "not utf-8": b"\xff\xfe" + text.encode(),
        "not an object": b"[1, 2, 3]",
        "no plan": json.dumps({"key": record["key"]}).encode(),
        "unknown path": json.dumps(
            {**record, "plan": {**plan, "prefill_path": "fastest"}}
        ).encode(),
        "bad rows": json.dumps(
            {**record, "plan": {**plan, "decode_paths": [{"max_rows": "many", "path": "torch"}]}}
        ).encode(),
    }[corrupt]
    path.write_bytes(damaged)
    probe = CountingProbe()
    with caplog.at_level(logging.WARNING, logger="kvchat.inference.model.linear_plan_cache"):
        plan_again = load_or_measure(layers(), torch.float32, cache, probe)
    assert probe.calls == 1 and not plan_again.cached and plan_again.cache_file == str(path)
    assert any(
        str(path) in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records
    )
    assert json.loads(path.read_text())["key"] == record["key"]  # rewritten whole
    assert load_or_measure(layers(), torch.float32, cache, probe).cached
    assert probe.calls == 1


def test_a_file_kept_for_another_key_is_measured_over(tmp_path: Path) -> None:
    cache = LinearPlanCache(tmp_path)
    path, record = kept_plan_record(cache)
    record["key"] = {**record["key"], "cpu_count": -1}  # type: ignore[dict-item]
    path.write_text(json.dumps(record))
    probe = CountingProbe()
    assert not load_or_measure(layers(), torch.float32, cache, probe).cached
    assert probe.calls == 1 and json.loads(path.read_text())["key"]["cpu_count"] == os.cpu_count()


def test_an_unwritable_cache_directory_still_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")
    cache = LinearPlanCache(tmp_path / "a-file" / "plans")
    with caplog.at_level(logging.WARNING, logger="kvchat.inference.model.linear_plan_cache"):
        plan = load_or_measure(layers(), torch.float32, cache)
    assert plan.reason == "measured" and plan.cache_file is None and not plan.cached
    assert any("cannot write" in r.getMessage() for r in caplog.records)


def test_refresh_measures_again_and_rewrites(tmp_path: Path) -> None:
    path, record = kept_plan_record(LinearPlanCache(tmp_path))
    record["measure_seconds"] = -1.0
    path.write_text(json.dumps(record))
    probe = CountingProbe()
    plan = load_or_measure(layers(), torch.float32, LinearPlanCache(tmp_path, refresh=True), probe)
    assert probe.calls == 1 and not plan.cached and plan.cache_file == str(path)
    assert json.loads(path.read_text())["measure_seconds"] > 0


def test_a_forced_path_neither_reads_nor_writes_the_cache(tmp_path: Path) -> None:
    plan = plan_for(layers(), torch.float32, CPU, "torch", LinearPlanCache(tmp_path))
    assert plan.reason == "set by linear_path" and plan.cache_file is None
    assert list(tmp_path.iterdir()) == []


def test_settings_choose_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_plan_dir() == tmp_path / "xdg" / "kvchat" / "linear_plans"
    on = Settings(model=Path("m")).engine_config()
    assert on.linear_plan_dir == str(default_plan_dir()) and not on.linear_plan_refresh
    there = Settings(model=Path("m"), linear_plan_dir=tmp_path / "p").engine_config()
    assert there.linear_plan_dir == str(tmp_path / "p")
    refresh = Settings(model=Path("m"), linear_plan_cache="refresh").engine_config()
    assert refresh.linear_plan_refresh
    assert (
        Settings(model=Path("m"), linear_plan_cache="off").engine_config().linear_plan_dir is None
    )


ENGINE_PLAN = """
import json, sys
from pathlib import Path
from kvchat.app.settings import Settings
from kvchat.inference import Engine
# the test runs beside others: their CPU use does not stop the plan from being kept here
settings = Settings(model=Path(sys.argv[1]), linear_plan_dir=Path(sys.argv[2]), max_model_len=256,
                    linear_plan_busy_cpus=64)
print(json.dumps(Engine(settings.engine_config()).model.linear_plan.as_dict()))
"""


def test_a_restarted_engine_loads_the_plan_its_first_start_kept(
    dev_model: Path, tmp_path: Path
) -> None:
    def start() -> dict[str, object]:
        proc = subprocess.run(
            [sys.executable, "-P", "-c", ENGINE_PLAN, str(dev_model), str(tmp_path)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout.splitlines()[-1]))

    first, second = start(), start()
    assert first["cached"] is False and second["cached"] is True
    assert first["cache_file"] == second["cache_file"]
    assert Path(str(first["cache_file"])).parent == tmp_path
    for name in ("weights", "decode_paths", "prefill_path", "lm_head_decode_paths"):
        assert second[name] == first[name]
