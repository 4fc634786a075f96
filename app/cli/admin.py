"""`kvchat admin ...`: the operator API of a running server, from the command line (rich
tables). The server is --url or KVCHAT_URL (default http://127.0.0.1:8000); the admin key is
--key or KVCHAT_API_KEY."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer

admin_app = typer.Typer(
    help="Operate a running server: memory, session budgets, evictions.", no_args_is_help=True
)

UrlOption = Annotated[str, typer.Option(envvar="KVCHAT_URL", help="The server.")]
KeyOption = Annotated[str | None, typer.Option(envvar="KVCHAT_API_KEY", help="An admin key.")]
DEFAULT_URL = "http://127.0.0.1:8000"


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def call(method: str, url: str, key: str | None, path: str, **kwargs: Any) -> Any:
    import httpx

    if not key:
        fail("an admin key is needed: --key or KVCHAT_API_KEY")
    try:
        r = httpx.request(
            method,
            url.rstrip("/") + path,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
            **kwargs,
        )
    except httpx.HTTPError as e:
        fail(f"cannot reach {url}: {e}")
    if r.status_code >= 400:
        try:
            error = r.json()["error"]
            fail(f"{r.status_code} {error.get('code') or ''}: {error['message']}")
        except (ValueError, KeyError, TypeError):
            fail(f"{r.status_code}: {r.text[:200]}")
    return r.json()


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


@admin_app.command("memory")
def memory(url: UrlOption = DEFAULT_URL, key: KeyOption = None) -> None:
    """The KV pool, the host pool, pinned sessions and where prefill tokens came from."""
    from rich.console import Console
    from rich.table import Table

    m = call("GET", url, key, "/v1/admin/memory")
    console = Console()
    pool, host = m["pool"], m["host_pool"]
    table = Table(title=f"KV memory ({m['kv_cache_dtype']}, {m['bytes_per_token']} B/token)")
    for column in ("pool", "blocks used / total", "bytes used / total", "usage"):
        table.add_column(column)
    table.add_row(
        "device",
        f"{pool['used_blocks']} / {pool['num_blocks']}",
        f"{_mib(pool['used_bytes'])} / {_mib(pool['bytes'])}",
        f"{pool['usage']:.1%}",
    )
    table.add_row(
        "host",
        f"{host['used_blocks']} / {host['num_blocks']}",
        f"{_mib(host['used_bytes'])} / {_mib(host['bytes'])}",
        f"{host['used_blocks'] / max(1, host['num_blocks']):.1%}",
    )
    console.print(table)
    sessions = Table(title=f"sessions ({len(m['sessions'])})")
    for column in (
        "conversation",
        "state",
        "tokens",
        "idle s",
        "max_kv_tokens",
        "max_context_tokens",
    ):
        sessions.add_column(column)
    for s in m["sessions"]:
        sessions.add_row(
            s["conversation_id"],
            s["state"],
            str(s["tokens"]),
            "" if s["idle_seconds"] is None else f"{s['idle_seconds']:.0f}",
            str(s["budget"]["max_kv_tokens"]),
            str(s["budget"]["max_context_tokens"]),
        )
    console.print(sessions)
    sources = Table(
        title=f"prefill tokens (prefix-cache hit rate {m['prefix_cache']['hit_rate']:.1%})"
    )
    for column in m["prefill_sources"]:
        sources.add_column(column)
    sources.add_row(*(f"{v:,}" for v in m["prefill_sources"].values()))
    console.print(sources)
    events = Table(title="events")
    for column in ("offloads", "restores", "drops", "preemptions", "trims", "summaries"):
        events.add_column(column)
    events.add_row(
        str(m["evictions"]["offloads"]),
        str(m["evictions"]["restores"]),
        str(m["evictions"]["drops"]),
        str(m["preemptions"]["swap"] + m["preemptions"]["recompute"]),
        str(m["history"]["trims"]),
        str(m["history"]["summaries"]),
    )
    console.print(events)


@admin_app.command("session")
def session(
    conversation_id: Annotated[str, typer.Argument(help="The conversation (session) id.")],
    max_kv_tokens: Annotated[int | None, typer.Option(help="Pinned-KV cap.")] = None,
    max_context_tokens: Annotated[int | None, typer.Option(help="Prompt budget.")] = None,
    policy: Annotated[
        str | None, typer.Option(help="History policy: summarize, drop, drop_oldest, none.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Show a session's budget and state; with options, change them (from its next turn)."""
    from rich.console import Console
    from rich.table import Table

    changes = {
        k: v
        for k, v in dict(
            max_kv_tokens=max_kv_tokens,
            max_context_tokens=max_context_tokens,
            history_policy=policy,
        ).items()
        if v is not None
    }
    path = f"/v1/admin/sessions/{conversation_id}"
    s = call("PUT", url, key, path, json=changes) if changes else call("GET", url, key, path)
    table = Table(title=f"session {s['conversation_id']} (owner {s['owner']})")
    for column in ("setting", "stored", "in effect"):
        table.add_column(column)
    for name, value in s["effective"].items():
        table.add_row(name, str(s["settings"].get(name)), str(value))
    engine = s["engine"] or {}
    table.add_row("state", "", str(engine.get("state", "unknown")))
    table.add_row("pinned tokens", "", str(engine.get("tokens", 0)))
    table.add_row("lease holder", "", str(s["lease_holder"]))
    Console().print(table)


@admin_app.command("evict")
def evict(
    conversation_id: Annotated[str, typer.Argument(help="The conversation (session) id.")],
    drop: Annotated[bool, typer.Option(help="Drop the KV instead of moving it to host.")] = False,
    url: UrlOption = DEFAULT_URL,
    key: KeyOption = None,
) -> None:
    """Move an idle session's KV to the host pool (or drop it)."""
    r = call(
        "POST",
        url,
        key,
        f"/v1/admin/sessions/{conversation_id}/evict",
        params={"offload": str(not drop).lower()},
    )
    typer.echo(f"{r['conversation_id']}: {r['before']} -> {r['state']}")
