"""kvchat memory plan: reproduces the published bytes-per-token figures, shows its arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvchat.app.cli.main import app
from kvchat.inference.model.config import ModelConfig
from kvchat.memory.kv_spec import KVCacheSpec
from kvchat.memory.pool_sizing import MemoryPlan, parse_bytes

CONFIGS = Path(__file__).parent / "configs"
runner = CliRunner()


@pytest.mark.parametrize(
    ("name", "bytes_per_token", "parameters"),
    [
        ("llama-3-8b.json", 131_072, 8_030_261_248),
        ("llama-3.2-1b.json", 32_768, 1_235_814_400),
        ("qwen2.5-0.5b.json", 12_288, 494_032_768),
    ],
)
def test_published_bytes_per_token_in_bf16(
    name: str, bytes_per_token: int, parameters: int
) -> None:
    result = runner.invoke(app, ["memory", "plan", "--config", str(CONFIGS / name)])
    assert result.exit_code == 0, result.output
    assert f"= {bytes_per_token:,} B" in result.stdout.splitlines()[2]
    config = ModelConfig.from_hf_dict(json.loads((CONFIGS / name).read_text()))
    assert config.num_parameters == parameters


def test_blocks_and_sessions_that_fit_with_the_arithmetic() -> None:
    result = runner.invoke(
        app,
        [
            "memory",
            "plan",
            "--config",
            str(CONFIGS / "llama-3-8b.json"),
            "--memory",
            "80GiB",
            "--utilization",
            "0.9",
            "--context-tokens",
            "8192",
        ],
    )
    assert result.exit_code == 0, result.output
    weights = 8_030_261_248 * 2
    usable = int(80 * 2**30 * 0.9) - weights
    blocks = usable // (131_072 * 16)
    out = result.stdout
    assert "bytes per block = 131,072 B x 16 tokens = 2,097,152 B" in out
    blocks_line = (
        f"blocks = {usable:,} B / 2,097,152 B = {blocks:,} blocks = {blocks * 16:,} tokens"
    )
    assert blocks_line in out
    assert f"sessions that fit = {blocks:,} / 512 = {blocks // 512:,}" in out


def test_quantized_cache_counts_its_scales() -> None:
    result = runner.invoke(
        app,
        ["memory", "plan", "--config", str(CONFIGS / "llama-3-8b.json"), "--kv-cache-dtype", "fp8"],
    )
    assert result.exit_code == 0, result.output
    # 65,536 B of fp8 values + 2 x 32 x 8 x 4 groups x 2 B of float16 scales.
    assert "-> 69,632 B per token" in result.stdout
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16, "int8")
    assert spec.bytes_per_token / KVCacheSpec(32, 8, 128, 16, torch.bfloat16).bytes_per_token < 0.55
    config = str(CONFIGS / "llama-3-8b.json")
    int4 = runner.invoke(app, ["memory", "plan", "--config", config, "--kv-cache-dtype", "int4"])
    assert int4.exit_code == 0, int4.output
    # 32,768 B of packed codes + 2 x 32 x 8 x 4 groups x 2 B of float16 scales.
    assert "x 0.5 B = 32,768 B" in int4.stdout
    assert "-> 36,864 B per token" in int4.stdout


def test_plan_math_matches_a_direct_computation() -> None:
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, model_dtype=torch.float32
    )
    plan = MemoryPlan(
        spec, weight_bytes=1000, memory_bytes=10**6, utilization=0.5, context_tokens=100
    )
    assert spec.bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert plan.usable_bytes == 499_000
    assert plan.num_blocks == 499_000 // (2048 * 16)
    assert plan.blocks_per_session == 7
    assert plan.num_sessions == plan.num_blocks // 7


def test_model_dir_works_like_its_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((CONFIGS / "qwen2.5-0.5b.json").read_text())
    by_dir = runner.invoke(app, ["memory", "plan", "--model", str(tmp_path)])
    by_file = runner.invoke(app, ["memory", "plan", "--config", str(tmp_path / "config.json")])
    assert by_dir.exit_code == 0 and by_dir.stdout == by_file.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --model or --config"),
        (["--config", "/nope.json"], "does not exist"),
        (["--config", str(CONFIGS / "llama-3-8b.json"), "--memory", "lots"], "cannot read 'lots'"),
        (
            ["--config", str(CONFIGS / "llama-3-8b.json"), "--kv-cache-dtype", "int2"],
            "kv_cache_dtype",
        ),
        (["--config", str(CONFIGS / "llama-3-8b.json"), "--block-size", "12"], "power of two"),
        (["--config", str(CONFIGS / "llama-3-8b.json"), "--utilization", "1.5"], "utilization"),
    ],
)
def test_bad_input_gets_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["memory", "plan", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_parse_bytes_units() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141 GB") == 141 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e6") == 10**6
    with pytest.raises(ValueError):
        parse_bytes("-1GB")
