"""CpuThreads: how many threads torch's CPU ops use for each step, chosen by timing the steps.

Alone on its cores, a step is fastest on all of them (a 1,000-token prefill of
SmolLM2-135M-Instruct takes 1.9 s on two Zen 4 cores, 2.8 s on one). When another process
takes a core, every OpenMP parallel region (a step runs about fifty) waits at its barrier for
the thread that is not running, while the others spin: the same prefill takes 4.7 s on two
threads and 2.9 s on one, and served decode falls from ~32 to ~10 tokens/s on two threads
where one thread keeps ~32. Which count is faster depends on what else the machine runs now,
so it is measured, not assumed: each step is timed under its shape (prefill or decode, and its
size rounded up to a power of two); a moving average of the count in use is kept per shape,
and now and then a step of the shape runs on the other count (a probe) so its figure stays
current; the faster count runs (CpuThreads says when probes come).

The thread count changes only between steps, on the engine's thread (OpenMP's thread count
is per calling thread); tokens do not depend on it (every op splits its work by outputs, not
by reductions: tests/inference/test_cpu_threads.py checks it on the engine)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Shape = tuple[str, int]  # ("decode", sequences) or ("prefill", tokens), rounded up to 2^k


def step_shape(num_tokens: int, num_decode: int, num_seqs: int) -> Shape:
    """The shape a step's time is compared under: decode-only steps by their sequences,
    steps that prefill by their tokens, each rounded up to a power of two."""
    if num_decode == num_seqs:
        return ("decode", _pow2(num_seqs))
    return ("prefill", _pow2(num_tokens))


_TORCH_THREADS: list[int] = []


def _torch_threads() -> int:
    """torch's thread count as the process started with it: an engine's steps change it, and
    an engine built later in the same process chooses up to the same count."""
    if not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    return _TORCH_THREADS[0]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _ShapeTimes:
    seconds: dict[int, float] = field(default_factory=dict)  # thread count -> moving average
    steps: int = 0
    interval: int = 0  # steps between probes now
    next_probe: int = 0  # the step that probes next
    preferred: int | None = None  # the faster count, once every count is measured
    probes: int = 0


class CpuThreads:
    """Chooses the thread count of each step among `choices` (e.g. (1, 2)) from the steps'
    own times. `set_threads` applies a count (torch.set_num_threads; injected in tests).

    A shape runs on its faster count; until every count of it is measured, on the count the
    last compared shape preferred (the machine's state, not the shape's, is what changes).
    Probes (a step on another count) come every `probe_every` steps of a shape, twice as far
    apart after each probe that confirms the choice (up to `max_probe_every`: a probe on a
    contended machine costs a slow step), and every `probe_every` again once the choice
    changes. A count whose own steps slow past another's figure is left at once, probe or
    not: a core taken shows within a step or two, a core given back within a few probes."""

    def __init__(
        self,
        choices: tuple[int, ...],
        *,
        probe_every: int = 16,
        max_probe_every: int = 256,
        weight: float = 0.5,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if not choices or any(n < 1 for n in choices):
            raise ValueError(f"thread counts must be >= 1, got {choices}")
        self.choices = tuple(sorted(set(choices)))
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.weight = weight  # of the newest step in the moving average
        self._set_threads = set_threads
        self._shapes: dict[Shape, _ShapeTimes] = {}
        self.current = self.choices[-1]
        self.verdict = self.choices[-1]  # what the last compared shape preferred
        self.num_switches = 0

    @classmethod
    def for_device(cls, device: torch.device, enabled: bool = True) -> CpuThreads | None:
        """A chooser between one thread and torch's count, for a CPU engine with more than one
        thread; None otherwise (nothing to choose)."""
        threads = _torch_threads()
        if not enabled or device.type != "cpu" or threads < 2:
            return None
        return cls((1, threads))

    def choose(self, shape: Shape) -> int:
        """The thread count for the next step of `shape`, applied."""
        times = self._times(shape)
        times.steps += 1
        best = times.preferred if times.preferred is not None else self.verdict
        threads = best
        if times.steps >= times.next_probe:
            unmeasured = [n for n in self.choices if n not in times.seconds and n != best]
            others = unmeasured or [n for n in self.choices if n != best]
            threads = others[times.probes % len(others)]
            times.probes += 1
            times.next_probe = times.steps + times.interval
        if threads != self.current:
            self._set_threads(threads)
            self.current = threads
            self.num_switches += 1
        return threads

    def record(self, shape: Shape, threads: int, seconds: float) -> None:
        """The time a step of `shape` took on `threads`."""
        times = self._times(shape)
        previous = times.seconds.get(threads)
        if previous is None or threads != times.preferred:
            # a probe: the only news of this count since its last one, taken whole
            times.seconds[threads] = seconds
        else:
            times.seconds[threads] = previous + self.weight * (seconds - previous)
        if len(times.seconds) < len(self.choices):
            return
        preferred = min(self.choices, key=lambda n: times.seconds[n])
        if preferred != times.preferred:  # a new choice: look again soon
            times.interval = self.probe_every
        elif threads != preferred:  # a probe that confirmed the choice: look again later
            times.interval = min(2 * times.interval, self.max_probe_every)
        else:
            return
        times.next_probe = times.steps + times.interval
        times.preferred = self.verdict = preferred

    def preferred(self, shape: Shape) -> int | None:
        """The count steps of `shape` run on now (None until every count is measured)."""
        times = self._shapes.get(shape)
        return times.preferred if times is not None else None

    def _times(self, shape: Shape) -> _ShapeTimes:
        times = self._shapes.get(shape)
        if times is None:
            times = self._shapes[shape] = _ShapeTimes(
                interval=self.probe_every, next_probe=self.probe_every
            )
        return times
