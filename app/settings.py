"""Settings: the one pydantic-settings class of the service (KVCHAT_* environment variables,
a .env file, and every field a flag of `kvchat serve`: app/cli/settings_flags.py), and the one
place the engine's configuration is built from it. Every field needs a description: it is its
flag's help.

Never imports torch: the engine configuration is built lazily (`engine_config()`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvchat.app.session_settings import SessionSettings

if TYPE_CHECKING:
    from kvchat.inference import EngineConfig

DEFAULT_MODEL_DIR = Path("models/smollm2-135m-instruct")


class Settings(BaseSettings, SessionSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVCHAT_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    # -- the model and the engine ---------------------------------------------------------------
    model: Path = Field(DEFAULT_MODEL_DIR, description="Hugging Face model directory.")
    served_model_name: str | None = Field(
        None, description="The model id clients name (default: the model directory's name)."
    )
    device: str = Field("auto", description="auto (CUDA when available), cpu, or cuda[:N].")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations (auto: float32 on CPU, bfloat16 on CUDA)."
    )
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="Attention kernels (auto: Triton on CUDA, torch on CPU)."
    )
    linear_path: Literal["auto", "gemv", "gemv-prefetch", "torch", "onednn", "onednn-prepacked"] = (
        Field(
            "auto", description="CPU linear layers: auto measures the candidate paths at start-up."
        )
    )
    linear_plan_cache: Literal["on", "refresh", "off"] = Field(
        "on",
        description="linear_path auto: keep the probe's result per machine and model shape "
        "in linear_plan_dir and load it at the next start (on); measure again and overwrite "
        "it (refresh); measure at every start, keep nothing (off).",
    )
    linear_plan_dir: Path | None = Field(
        None,
        description="Where measured linear plans are kept "
        "(default: $XDG_CACHE_HOME/kvchat/linear_plans, else ~/.cache/kvchat/linear_plans).",
    )
    linear_plan_busy_cpus: float = Field(
        0.3,
        ge=0,
        description="A linear plan measured while other processes kept more than this many "
        "CPUs busy on average (its timings are off) serves that run and is not kept: the next "
        "start measures again.",
    )
    block_size: int = Field(16, description="Tokens per KV-cache block.")
    kv_cache_dtype: Literal["auto", "int8", "fp8", "int4"] = Field(
        "auto",
        description="KV-cache element type (auto: the model's dtype; int8 and fp8 about half "
        "a bfloat16 cache's bytes, int4 0.28x of them, at a measured cost in quality: README).",
    )
    kv_cache_bytes: int | None = Field(None, description="KV pool size (CPU, or CUDA override).")
    gpu_memory_utilization: float = Field(
        0.9, description="Fraction of CUDA memory the weights and the KV pool may use."
    )
    host_cache_bytes: int = Field(256 * 2**20, description="Host pool for offloaded sessions.")
    retention: Literal["lru", "pinned", "predictive"] = Field(
        "predictive",
        description="Which idle session's KV stays where under memory pressure: predictive "
        "(by when its next turn will come: tool calls, its gaps, its client's and operator's "
        "hints, typing), pinned (least recently used moves down first), lru (nothing kept "
        "past a turn but the prefix cache, as vLLM).",
    )
    kv_store_dir: Path | None = Field(
        None,
        description="The KV store: full KV blocks on disk, written behind each turn and "
        "loaded instead of recomputing (a shared volume in a fleet). Default: data_dir/kv.",
    )
    kv_store_bytes: int = Field(
        4 * 2**30,
        ge=0,
        description="The KV store's byte cap (least recently used files are "
        "evicted past it); 0 turns the store off.",
    )
    max_model_len: int | None = Field(
        None, description="Longest sequence (default: the model's max_position_embeddings)."
    )
    max_num_seqs: int = Field(64, description="Sequences scheduled in one engine step at most.")
    max_num_batched_tokens: int = Field(
        512, description="Tokens (prefill chunks and decodes) in one engine step at most."
    )
    max_solo_prefill_tokens: int | None = Field(
        2048,
        ge=1,
        description="Tokens one engine step may prefill while no request is generating (none "
        "has its next token waiting on the step): a prompt arriving alone runs in fewer, larger "
        "steps. Null: every step takes max_num_batched_tokens at most.",
    )
    max_queued_requests: int = Field(
        256, description="Waiting requests above this answer 503 with Retry-After."
    )
    seed: int | None = Field(0, description="Sampling seed of requests that give none.")
    grammar_checks_first: bool = Field(
        True,
        description="Structured output: check a constrained row's draws against its "
        "grammar before computing its mask (the mask only when all are rejected); false masks "
        "every step.",
    )
    adaptive_cpu_threads: bool = Field(
        True,
        description="On the CPU, run each engine step on one thread or on all of torch's, "
        "whichever recent steps of its shape were faster on: a core taken by another process "
        "then costs little; false always uses all.",
    )

    # -- sessions and history: the defaults of conversations that set none of their own (the
    # fields of SessionSettings, app/session_settings.py; operators change them per session) ---
    summarizer: Literal["model", "extractive"] = Field(
        "model",
        description="How running summaries are made: model (the served model writes them; one "
        "that is empty, copies the transcript, repeats itself or loses a number or name is "
        "replaced by the extract) or extractive (the dropped user messages' sentences, "
        "nothing generated).",
    )
    default_max_tokens: int = Field(
        512, description="Reply budget reserved when a request gives no max_tokens."
    )

    # -- the service -----------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, description="Port to listen on.")
    data_dir: Path = Field(
        Path("data"), description="The embedded database and the KV store live here."
    )
    database_url: str | None = Field(None, description="Default: SQLite in data_dir.")
    redis_url: str | None = Field(None, description="Unset: in-process coordination.")
    redis_prefix: str = Field("kvchat:", description="Prefix of every Redis key and channel.")
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins allowed to call the API and open WebSockets "
        "(as a variable: a JSON list).",
    )
    drain_timeout: float = Field(10.0, description="Seconds in-flight turns get at shutdown.")
    drain_grace: float = Field(
        0.0,
        ge=0,
        description="Seconds a replica keeps serving after SIGTERM while /readyz "
        "answers 503 `draining`, so a load balancer takes it out of rotation before it stops "
        "listening (0: stop at once, a single process's default; app/ops/drain.py).",
    )
    drain_probes: int = Field(
        0,
        ge=0,
        description="The grace ends early once /readyz has answered `draining` this "
        "many times: the balancer's health check has seen it (0: only drain_grace counts).",
    )
    log_level: str = Field("info", description="critical, error, warning, info or debug.")
    replica_id: str | None = Field(
        None, description="This process's name in session leases (default: host:port:pid)."
    )
    lease_ttl: float = Field(30.0, description="Session ownership leases expire unless renewed.")
    keyless_sessions: bool = Field(
        False,
        description="Stateless chat completions without X-Session-Id run in a session "
        "named by their opening (the first message, and the second when the first is a system "
        "message), as a load balancer routes them: each call reuses the last one's KV "
        "exactly, its replies spliced back by their ids. A fleet turns it on.",
    )
    turn_lock_ttl: float = Field(
        10.0,
        gt=0,
        description="A conversation's turn lock expires this long after its "
        "holder last renewed it (renewed every third of it while the turn runs): a crashed "
        "process's conversations take turns again within it.",
    )
    reply_checkpoint_interval: float = Field(
        1.0,
        ge=0,
        description="Seconds between writes of a generating reply's text so far "
        "(what a crash leaves of it); 0: only the final write.",
    )

    # -- request bodies --------------------------------------------------------------------------
    max_request_bytes: int = Field(
        4 * 2**20,
        ge=1024,
        description="Larger request bodies are answered 413 "
        "(request_too_large): on their Content-Length before they are read, or once a chunked "
        "body passes it.",
    )

    # -- limits (per API key; unset: none) ------------------------------------------------------
    rate_limit_requests: int | None = Field(None, ge=1, description="Requests per minute per key.")
    rate_limit_tokens: int | None = Field(None, ge=1, description="Tokens per minute per key.")

    # -- WebSocket -------------------------------------------------------------------------------
    ws_grace_period: float = Field(
        30.0, description="A reply goes on this long after its socket drops (resume window)."
    )
    ws_max_frame_bytes: int = Field(
        256 * 1024,
        ge=1024,
        description="Larger frames get a frame_too_large error frame (the "
        "socket stays open) up to ws_protocol_max_bytes; past that the protocol closes the "
        "socket (1009) before buffering the frame.",
    )
    ws_compression: bool = Field(
        False,
        description="Offer permessage-deflate on WebSockets (token deltas are small "
        "frames: compressing them costs CPU beside the decoder and saves little).",
    )
    ws_max_connections_per_key: int = Field(16, description="Open WebSockets per API key at most.")
    ws_idle_timeout: float = Field(300.0, description="Close a socket silent this long.")

    @model_validator(mode="after")
    def _history_policy_defaults(self) -> Settings:
        """Checks the policy (raises with the field named) and writes its defaults in for
        the fields left unset."""
        for name, value in SessionSettings.of(self).filled().model_dump().items():
            setattr(self, name, value)
        return self

    @property
    def ws_protocol_max_bytes(self) -> int:
        """The largest frame uvicorn buffers for the app (its `ws_max_size`): a few frame
        limits, so a frame a little too large is answered, a huge one refused unread."""
        return 4 * self.ws_max_frame_bytes

    @property
    def database(self) -> str:
        from kvchat.app.store import default_database_url

        return self.database_url or default_database_url(self.data_dir)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name

    @property
    def is_embedded_database(self) -> bool:
        return self.database.startswith("sqlite")

    def session_defaults(self) -> SessionSettings:
        """The settings of sessions that set none of their own."""
        return SessionSettings.of(self)

    @property
    def kv_store_path(self) -> Path:
        return self.kv_store_dir if self.kv_store_dir is not None else self.data_dir / "kv"

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: built here and nowhere else."""
        from kvchat.inference import EngineConfig, SchedulerConfig, default_plan_dir
        from kvchat.memory import CacheConfig, RetentionConfig, SessionBudget

        return EngineConfig(
            model=str(self.model),
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            linear_path=self.linear_path,
            linear_plan_dir=None
            if self.linear_plan_cache == "off"
            else str(self.linear_plan_dir or default_plan_dir()),
            linear_plan_refresh=self.linear_plan_cache == "refresh",
            linear_plan_busy_cpus=self.linear_plan_busy_cpus,
            max_model_len=self.max_model_len,
            seed=self.seed,
            grammar_checks_first=self.grammar_checks_first,
            adaptive_cpu_threads=self.adaptive_cpu_threads,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_bytes=self.kv_cache_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                host_cache_bytes=self.host_cache_bytes,
                kv_store_dir=str(self.kv_store_path),
                kv_store_bytes=self.kv_store_bytes,
                retention=RetentionConfig(mode=self.retention),
                default_budget=SessionBudget(
                    max_kv_tokens=self.max_kv_tokens,
                    max_context_tokens=self.max_context_tokens,
                    retention_ttl_s=self.retention_ttl_s,
                    retention_priority=self.retention_priority,
                ),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_solo_prefill_tokens=self.max_solo_prefill_tokens,
            ),
        )
