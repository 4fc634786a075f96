"""Scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (oldest first; a decode needs one token, a prompt being
prefilled takes a chunk), then swapped-out ones come back, then waiting ones are admitted
while the token budget, the sequence limit and free blocks allow. The budget is
max_num_batched_tokens, or max_solo_prefill_tokens in a step where no request is generating
(vLLM's CPU server takes 2,048 for every step; kvchat keeps decodes' stalls short and gives
a prompt that arrives alone the large steps). Before a new sequence
prefills anything, the KV it can reuse is looked up: its session's pinned blocks, then the
prefix cache.

When blocks run short, idle sessions go first (offloaded or dropped, coldest first); running
sequences are never evicted for idle ones' sake. When running sequences alone exhaust the
pool, the newest is preempted (swapped to host when there is room, else recomputed later).

A request of a session that ends leaves one token without KV (the last it sampled). It is
computed in a following step, without sampling (FINISHING), when a free block allows, so the
session pins every token of the turn; the session's next turn waits that one step for it.

Priorities: a request's `priority` orders it (lower first, like vLLM). Requests above
PRIORITY_NORMAL are background work (history summaries): they get only the token budget and
the free blocks that normal requests leave this step, never evict an idle session or preempt
a normal request for their own sake, and are the first to be preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvchat.memory.kv_cache_manager import KVCacheManager
from kvchat.memory.kv_spec import cdiv
from kvchat.memory.sessions import SessionStore
from kvchat.memory.stats import CacheStats

from .priority import PRIORITY_NORMAL
from .sequence import PrefillAccounting, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # A step in which no request is generating may prefill this many tokens (when larger):
    # chunks bound how long a prefill stalls other requests' next tokens, and with none to
    # stall, a prompt that arrives alone runs in fewer, larger steps. None: no larger step.
    max_solo_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_solo_prefill_tokens is not None and self.max_solo_prefill_tokens < 1:
            raise ValueError(
                f"max_solo_prefill_tokens must be >= 1, got {self.max_solo_prefill_tokens}"
            )

    @property
    def max_step_tokens(self) -> int:
        """The most tokens any one step runs (what activations are sized for)."""
        return max(self.max_num_batched_tokens, self.max_solo_prefill_tokens or 0)


@dataclass
class ScheduledBatch:
    """Sequences to run this step, decodes (one new token) first, with their token counts."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that cannot make progress at all (the pool is too small for them alone).
    out_of_memory: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class _Step:
    """What one schedule() call plans, as it goes."""

    budget: int
    planned: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_memory: list[Sequence] = field(default_factory=list)

    def plan(self, seq: Sequence, num_tokens: int) -> None:
        self.planned.append((seq, num_tokens))
        self.budget -= num_tokens

    def batch(self) -> ScheduledBatch:
        """Decodes (one new token) first, then prefill chunks."""
        decodes = [(s, n) for s, n in self.planned if n == 1]
        others = [(s, n) for s, n in self.planned if n != 1]
        ordered = decodes + others
        return ScheduledBatch(
            seqs=[s for s, _ in ordered],
            num_new_tokens=[n for _, n in ordered],
            num_decode=len(decodes),
            preempted=self.preempted,
            out_of_memory=self.out_of_memory,
        )


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        sessions: SessionStore,
        stats: CacheStats,
    ) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.pool = kv_manager.pool
        self.sessions = sessions
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.finishing: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """A sequence's output is final: release it now, or, in a session with its last token
        still without KV on the device, once a step has computed it."""
        if (
            seq.session_id is None
            or seq.kv.is_on_host
            or seq.num_uncomputed_tokens != 1
            or seq.window_applied
        ):
            self.remove(seq)
            return
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
                break
        seq.status = SequenceStatus.FINISHING
        self.finishing.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted): its KV goes to its session, or is freed."""
        for queue in (self.running, self.waiting, self.swapped, self.finishing):
            if seq in queue:
                queue.remove(seq)
                break
        if seq.kv.is_on_host:  # finished while swapped out (aborted): nothing to pin
            self.kv_manager.free(seq.kv)
        if seq.window_applied and seq.window is not None:
            # Only KV that full attention would have computed may be kept for reuse.
            keep = min(seq.kv.leading_tokens(self.kv_manager.block_size), seq.window.exact_tokens)
            self.kv_manager.truncate(seq.kv, keep)
        self.kv_manager.persist(seq.kv, seq.token_ids)  # write-behind to the KV store
        if seq.session_id is not None:
            end = "cancelled" if seq.finish_reason == "abort" else seq.finish_reason or "stop"
            self.sessions.release(seq.session_id, seq.request_id, seq.token_ids, seq.kv, end)
        else:
            self.kv_manager.free(seq.kv)
        seq.status = SequenceStatus.FINISHED

    def discard(self, seq: Sequence) -> None:
        """Take a failed sequence out: its KV is freed, never pinned in its session nor written
        to the KV store (a failed step may have left it half-written), and its session keeps
        nothing (the next turn recomputes)."""
        for queue in (self.running, self.waiting, self.swapped, self.finishing):
            if seq in queue:
                queue.remove(seq)
                break
        self.kv_manager.free(seq.kv)
        if seq.session_id is not None:
            self.sessions.abandon(seq.session_id, seq.request_id)
        seq.status = SequenceStatus.FINISHED

    # -- the step -------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Normal requests get the step's token budget and blocks first (running, then swapped
        and waiting ones); background requests get what is left."""
        self.sessions.maintain()
        step = _Step(budget=self._step_budget())
        self._plan_finishing(step)
        running = sorted(self.running, key=lambda s: s.priority)  # oldest first within one
        normal = [s for s in running if s.priority == PRIORITY_NORMAL]
        background = [s for s in running if s.priority != PRIORITY_NORMAL]
        # Background work is what preemption takes first, newest first.
        short = self._plan_running(normal, background, step)
        if not short:
            self._swap_in()
            self._admit([s for s in self.waiting if s.priority == PRIORITY_NORMAL], step)
        self._plan_running(background, [], step)
        if not short:
            self._admit(
                sorted(
                    (s for s in self.waiting if s.priority != PRIORITY_NORMAL),
                    key=lambda s: s.priority,
                ),
                step,
            )
        return step.batch()

    def _step_budget(self) -> int:
        """max_num_batched_tokens, or the solo prefill budget when no request is generating
        (none running with output, none swapped out): no one's next token waits on the step."""
        config = self.config
        if self.swapped or any(s.num_output_tokens for s in self.running):
            return config.max_num_batched_tokens
        return config.max_step_tokens

    def _plan_finishing(self, step: _Step) -> None:
        """Last tokens of finished session turns: one each, in free blocks only (otherwise
        the session pins one token less). A session whose next turn is already waiting pins
        one token less at once: that turn's prefill computes the token with the rest of its
        new tokens, and it starts this step instead of waiting a step for the pin."""
        next_turns = {s.session_id for s in self.waiting if s.session_id is not None}
        for seq in list(self.finishing):
            if seq.session_id in next_turns:
                self.remove(seq)
                continue
            need = self.kv_manager.blocks_to_reserve(seq.kv, seq.num_tokens)
            if step.budget == 0 or not self.pool.can_allocate(need):
                self.remove(seq)
                continue
            self.stats.cow_copies += self.kv_manager.reserve_slots(seq.kv, seq.num_tokens)
            step.plan(seq, 1)

    def _plan_running(self, queue: list[Sequence], victims: list[Sequence], step: _Step) -> bool:
        """Give running sequences their next tokens, oldest first; when blocks run out,
        preempt from `victims` (newest first), then the newest of `queue`, then the sequence
        itself. Returns whether a normal request found the pool short."""
        short = False
        queue = list(queue)
        while queue:
            seq = queue.pop(0)
            if step.budget == 0:
                continue
            n = seq.chunk(min(seq.num_uncomputed_tokens, step.budget))
            scheduled = True
            while not self._reserve(seq, n):
                short |= seq.priority == PRIORITY_NORMAL
                victim = victims.pop() if victims else (queue.pop() if queue else seq)
                if victim is seq and not step.planned and self._never_fits(seq, n):
                    step.out_of_memory.append(seq)
                    self.running.remove(seq)
                    scheduled = False
                    break
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is seq:
                    scheduled = False
                    break
            if scheduled:
                step.plan(seq, n)
        return short

    def _admit(self, candidates: list[Sequence], step: _Step) -> None:
        """Admit waiting sequences in order while budget, sequence slots and blocks allow.
        One that waits on held sessions (SessionStore.should_wait) lets only the turns of idle
        sessions on the device pass it: their KV is there already, and their admission is
        what a hold waits for."""
        held_back = False
        for seq in candidates:
            if step.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if held_back and not self.sessions.is_idle_on_device(seq.session_id):
                continue
            if seq.session_id is not None and any(
                f.session_id == seq.session_id for f in self.finishing
            ):
                continue  # its session's last turn pins its last token this step
            if not seq.reuse_checked:
                self._look_up_reuse(seq)
            else:  # blocks computed since the last look may now be cached
                seq.pending_reuse.from_prefix_cache += self.kv_manager.match_prefix(
                    seq.kv, seq.token_ids
                )
                seq.pending_reuse.from_store += self.kv_manager.load_from_store(
                    seq.kv, seq.token_ids
                )
            if self._prefix_in_flight(seq):
                continue  # a running prefill is computing its next blocks: wait for them
            if self._holds_back(seq):
                held_back = True
                continue
            n = seq.chunk(min(seq.num_uncomputed_tokens, step.budget))
            if not self._reserve(seq, n):
                return
            if seq.held_back_since is not None:
                seq.held_back_since = None
                self.stats.admissions_held_back += 1
            self.waiting.remove(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self._count_admission(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.plan(seq, n)

    def _holds_back(self, seq: Sequence) -> bool:
        """Whether `seq` (a normal request) waits rather than break holds for its whole prompt's
        blocks; from its first such wait on, it counts how long it has waited."""
        if seq.priority != PRIORITY_NORMAL or seq.was_admitted:
            return False  # background requests take free blocks only; a preempted one resumes
        need = self.kv_manager.blocks_to_reserve(seq.kv, seq.num_prompt_tokens)
        now = self.sessions.clock()
        waited = 0.0 if seq.held_back_since is None else now - seq.held_back_since
        if not self.sessions.should_wait(need, waited):
            return False
        if seq.held_back_since is None:
            seq.held_back_since = now
        return True

    # -- reuse -----------------------------------------------------------------------------------

    def _look_up_reuse(self, seq: Sequence) -> None:
        """Before the first prefill of an admission: take what the session and the prefix cache
        already hold for this sequence's tokens (counted once it is admitted)."""
        reuse = PrefillAccounting()
        if seq.session_id is not None and seq.kv.num_computed_tokens == 0:
            claimed = self.sessions.claim(
                seq.session_id, seq.kv.salt, seq.request_id, seq.token_ids, seq.kv
            )
            reuse.from_session = claimed.from_session
            reuse.from_host = claimed.from_host
            reuse.from_prefix_cache = claimed.from_prefix_cache
        reuse.from_prefix_cache += self.kv_manager.match_prefix(seq.kv, seq.token_ids)
        reuse.from_store = self.kv_manager.load_from_store(seq.kv, seq.token_ids)
        seq.pending_reuse = reuse
        seq.reuse_checked = True

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether the next full block `seq` would compute is being computed right now by a
        running prefill (same tokens, same tenant). Waiting a step then lets the prefix cache
        serve it, so a system prompt shared by requests arriving together is computed once."""
        prefix_cache = self.kv_manager.prefix_cache
        if not prefix_cache.enabled:
            return False
        bs = self.kv_manager.block_size
        kv = seq.kv
        index = kv.num_computed_tokens // bs
        if kv.num_computed_tokens % bs or len(kv.block_hashes) != index:
            return False
        # The last token is always computed, so only blocks before it can be served.
        wanted = prefix_cache.next_block_hash(kv.block_hashes, seq.token_ids[:-1], kv.salt)
        if wanted is None:
            return False
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            upcoming = self._prompt_hashes(other)
            first = other.num_computed_tokens // bs
            if wanted in upcoming[first:]:
                return True
        return False

    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        if seq.prompt_hashes is None:
            seq.prompt_hashes = self.kv_manager.prefix_cache.hash_chain(
                seq.prompt_token_ids, seq.kv.salt
            )
        return seq.prompt_hashes

    def _count_admission(self, seq: Sequence) -> None:
        reuse = seq.pending_reuse
        stats = self.stats
        if not seq.was_admitted:
            seq.was_admitted = True
            seq.accounting = reuse
            stats.prompt_tokens += seq.num_prompt_tokens
            stats.from_session += reuse.from_session
            stats.from_host += reuse.from_host
            stats.from_prefix_cache += reuse.from_prefix_cache
            stats.from_store += reuse.from_store
            stats.computed += seq.num_prompt_tokens - reuse.cached
        else:
            stats.recomputed += seq.num_tokens - reuse.cached

    def _reclaim_from_waiting(self, num_blocks: int, exclude: Sequence) -> bool:
        """Take back blocks that other waiting sequences hold from their reuse lookup (newest
        first); they look up again when admitted."""
        for seq in reversed(self.waiting):
            if self.pool.can_allocate(num_blocks):
                break
            if seq is not exclude and seq.kv.block_ids:
                self.kv_manager.free(seq.kv)
                seq.reuse_checked = False
        return self.pool.can_allocate(num_blocks)

    # -- blocks ----------------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make sure slots exist for the next `num_new_tokens` tokens of `seq`, making room
        from idle sessions if needed (background requests take free blocks only)."""
        total = seq.num_computed_tokens + num_new_tokens
        if seq.in_window:
            assert seq.window is not None
            self.kv_manager.release_out_of_window(seq.kv, seq.window, seq.num_computed_tokens)
        need = self.kv_manager.blocks_to_reserve(seq.kv, total)
        if seq.priority > PRIORITY_NORMAL:
            if not self.pool.can_allocate(need):
                return False
        elif not (
            self.pool.can_allocate(need)
            or self.sessions.make_room(need)
            or self._reclaim_from_waiting(need, exclude=seq)
        ):
            return False
        self.stats.cow_copies += self.kv_manager.reserve_slots(seq.kv, total)
        return True

    def _never_fits(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` could not run even with the pool to itself: a normal request that
        failed to reserve with nothing else planned (idle sessions already evicted) cannot;
        a background request can wait for normal ones to leave blocks free."""
        if seq.priority == PRIORITY_NORMAL:
            return True
        total = seq.num_computed_tokens + num_new_tokens
        return self.kv_manager.cdiv_blocks(total) + 1 > self.pool.num_blocks

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence's KV out to host if there is room, else free it to recompute."""
        if seq in self.running:
            self.running.remove(seq)
        blocks = seq.kv.block_ids
        if blocks and not seq.kv.has_holes and self.sessions.host_room(len(blocks)):
            self.kv_manager.swap_out(seq.kv)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.stats.preemptions_swap += 1
            return
        self.kv_manager.free(seq.kv)
        seq.reuse_checked = False
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions_recompute += 1

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = min(self.swapped, key=lambda s: s.priority)
            # Room for its blocks and the next token's, so it can step at once.
            need = max(len(seq.kv.host_block_ids), cdiv(seq.num_tokens, self.kv_manager.block_size))
            if not self.pool.can_allocate(need) and (
                seq.priority > PRIORITY_NORMAL or not self.sessions.make_room(need)
            ):
                return
            self.swapped.remove(seq)
            self.kv_manager.swap_in(seq.kv)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
