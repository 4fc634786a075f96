"""What a process that does not exit, or a stuck turn, is waiting on: `kill -USR1 <pid>` writes
every thread's stack (faulthandler, which works even with the GIL held) and then, once the event
loop's thread runs Python again, every asyncio task's await chain to stderr (the log).

A thread dump alone shows an idle event loop as one frame (uvloop runs in C), which says nothing
about which coroutine never finishes; the await chains do. A task's own stack is one frame (a
suspended coroutine's frame has no `f_back`), so the chain is followed through `cr_await`; an
`async with` over an `@asynccontextmanager` suspends inside an async generator reached only
through an `asend` object, so running async generators are listed as well."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import signal
import sys
import types
from collections.abc import Iterator
from types import FrameType
from typing import Any, TextIO


def await_chain(awaitable: Any) -> Iterator[str]:
    """`file:line in function` for each coroutine or generator `awaitable` is suspended in,
    outermost first."""
    seen: set[int] = set()
    while awaitable is not None and id(awaitable) not in seen:
        seen.add(id(awaitable))
        frame: FrameType | None = None
        for name in ("cr_frame", "ag_frame", "gi_frame"):
            frame = getattr(awaitable, name, None) or frame
        if frame is not None:
            yield f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        awaitable = next(
            (
                getattr(awaitable, name)
                for name in ("cr_await", "ag_await", "gi_yieldfrom")
                if getattr(awaitable, name, None) is not None
            ),
            None,
        )


def dump_tasks(out: TextIO = sys.stderr) -> None:
    """Every task of the running loop and every running async generator, with what each
    awaits; nothing when no loop runs in this thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    print(f"asyncio: {len(tasks)} tasks (most recent await last)", file=out)
    for task in tasks:
        print(f"Task {task.get_name()} ({task.get_coro()!r}):", file=out)
        for line in await_chain(task.get_coro()):
            print(f"  {line}", file=out)
    # `type(...) is`, not isinstance: no object's __class__ property runs (some warn).
    running = [g for g in gc.get_objects() if type(g) is types.AsyncGeneratorType and g.ag_running]
    for generator in running:
        print(f"Async generator {generator.__qualname__}:", file=out)
        for line in await_chain(generator):
            print(f"  {line}", file=out)
    out.flush()


def install(sig: int = signal.SIGUSR1) -> None:
    """On `sig`: the threads' stacks at once, then the asyncio tasks."""
    signal.signal(sig, lambda signum, frame: dump_tasks())
    faulthandler.register(sig, all_threads=True, chain=True)
