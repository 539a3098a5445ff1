"""A continuous-batching engine: one model, one scheduler thread, many requests decoded together.

    engine = Drama3Engine(model, max_batch=16)
    engine.start()
    handle = engine.submit(SpeechJob(input_ids, audio_codes, settings, seed=7))
    for event in handle.events():      # FramesEvent ..., then DoneEvent (or ErrorEvent)
        ...
    engine.stop()

Each scheduler step advances every running request by one frame with the decode step of
`generate()` (`decoding.step.step`: `draw`, then `feed`, one graph), over the running requests as items of one
`DecodeState` and one `DecodeCache`: the engine's cache is a pool of `max_batch` items (slots),
and the running requests are its first items. Between steps, a finished, failed or cancelled
request leaves at once (the items after it move up), and waiting requests are prefilled alone
(the prefill/decode split: a one-item `DecodeRun`, from a cached voice prefix where one matches)
and placed into the next free item, each with its own columns. Prompts are prefilled in pieces of
at most `prefill_chunk` rows, at most that many rows between two steps, and while requests run,
prefill takes at most `prefill_share` of the scheduler's time (`chunked_prefill`): a long prompt
never holds a running request for more than one step and one piece. On CUDA the next step is queued
before the last one is read (as `generate()` queues it: `decoding.loop.runs_ahead`), so the device
makes a step while the scheduler sends out the frames of the one before; a request that leaves
while a step made with it is queued gets nothing from that step.

One sampler draws for the whole batch, each request with its own settings, RAS window and
random-number key and counter (`decoding.counter_noise`, keyed as `generate(seed=s)` keys a batch
of one; the counter starts when the request joins), so what a request draws
never depends on what else runs: a request's codes with a given seed are the ones `generate()`
gives it alone, whether it runs alone or joins a busy batch mid-flight. Budgets, guards and
phoneme alignment are `generate()`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from ..codec.take_audio import ClickFilter
from ..decoding import (
    DecodeCache,
    DecodeRequest,
    DecodeRun,
    DecodeState,
    Drama3Sampler,
    FrameStep,
    PendingStep,
    RequestOptions,
    SamplingSettings,
    SteadyGuards,
    check_threads,
    compiled_functions,
    detect_anomalies,
    line_separators,
    make_sampler,
    overlong_factor,
    own_drawn_state,
    owned,
    resolve_alignment,
    resolve_request,
    resolve_threads,
    runs_ahead,
)
from .chunked_prefill import (
    DEFAULT_PREFILL_SHARE, OLDEST_EVERY, PrefillShare, PromptPrefill, check_prefill_settings, next_prompt,
    system_turn_boundary,
)
from .heap_trim import return_freed_memory
from .routing import routed

IDLE_TRIM_DELAY = 1.0
"""Seconds idle after a grown pool was dropped before the heap is trimmed once more: by then the
callers of the requests that grew it (the HTTP layer) have freed what they held."""

INITIAL_CAPACITY = 512
"""Columns each slot of the pool holds at first; doubled (one copy) when a request outgrows them."""


class QueueFull(Exception):
    """The engine's waiting queue is at its cap."""


class EngineStopped(Exception):
    """The engine is not running."""


@dataclass
class SpeechJob:
    """One prompt to speak.

    input_ids [1, rows], audio_codes [1, rows, num_codebooks]: the prompt rows (processor output);
    settings: sampling; seed: the request's seed (None: a random one, reported on the handle);
    max_new_tokens: frame cap (the budget is also capped at 2.5x the expected duration);
    timeout: seconds the request may take from submission, None for no limit.
    prefix: an optional `PrefixState` holding the prefilled state of the prompt's first rows.
    boundaries_left: line boundaries a line-by-line prompt still has to speak (the processor's
    `boundaries_left`); None reads them from the rows (`prompting.bare_rows`). Only an engine given
    an `audio_separator_token_id` speaks line by line.
    adapter: the name of a LoRA adapter of the engine's `adapters` registry the request speaks
    with (prefill and every frame), None for the base model.
    speak_span: (start, stop) rows of the text of the turn to speak (the processor's `speak_span`):
    its expected duration and budget come from it; None reads them from the rows.
    The job is resolved as `generate()` resolves a prompt (`decoding.request.resolve_request`).
    """

    input_ids: torch.Tensor
    audio_codes: torch.Tensor
    settings: SamplingSettings = SamplingSettings()
    seed: int | None = None
    max_new_tokens: int | None = None
    timeout: float | None = None
    prefix: object | None = None
    boundaries_left: int | None = None
    adapter: str | None = None
    speak_span: tuple[int, int] | torch.Tensor | None = None


@dataclass
class FramesEvent:
    """Frames [frames, num_codebooks] that are final (a click frame before eos is never sent)."""

    frames: torch.Tensor


@dataclass
class DoneEvent:
    """The request ended: finish_reason "eos" or "length"; codes [frames, num_codebooks] the whole
    take; anomalies: the guard findings on the codes (`detect_anomalies` without a waveform);
    line_boundaries: the frame index where each new line starts (line-by-line prompts), as
    `generate()` reports them."""

    finish_reason: str
    codes: torch.Tensor
    anomalies: list[str]
    budget: int
    expected_frames: float
    line_boundaries: list[int] = field(default_factory=list)


@dataclass
class ErrorEvent:
    """The request failed or was cancelled; `kind` is "cancelled", "timeout" or "error"."""

    kind: str
    message: str


class RequestHandle:
    """The caller's side of a request: events arrive on `queue`; `cancel()` ends it at the next step."""

    def __init__(self, request_id: int, job: SpeechJob, seed: int):
        self.id, self.job, self.seed = request_id, job, seed
        self.options = RequestOptions(job.settings, seed, job.max_new_tokens)  # checked before the job waits
        self.queue: queue.Queue = queue.Queue()
        self.submitted = time.perf_counter()
        self.first_frame_at: float | None = None
        self.finished_at: float | None = None
        self.frames = 0
        self.cancelled = threading.Event()
        self.lease = None  # the adapter's slot the request holds (adapters.Lease), None for the base model

    @property
    def adapter_slot(self) -> int:
        return 0 if self.lease is None else self.lease.slot

    def cancel(self) -> None:
        self.cancelled.set()

    def events(self, timeout: float | None = None):
        """Events until the last one (DoneEvent or ErrorEvent); `timeout` bounds each wait."""
        while True:
            event = self.queue.get(timeout=timeout)
            yield event
            if not isinstance(event, FramesEvent):
                return

    def result(self, timeout: float | None = None) -> DoneEvent | ErrorEvent:
        """Wait for the end of the request (the frames events are skipped)."""
        for event in self.events(timeout):
            if not isinstance(event, FramesEvent):
                return event
        raise AssertionError("unreachable")


@dataclass
class _Slot:
    """A running request: its handle and its resolved request (one item: sampling, seed, RAS window,
    budgets, line boundaries left, alignment), its click filter, frames so far, the rows its item
    holds (the backbone's; the tower holds one fewer between steps) and the line boundaries it drew."""

    handle: RequestHandle
    request: DecodeRequest
    rows: int = 0
    line_boundaries: list[int] = field(default_factory=list)
    clicks: ClickFilter = field(default_factory=ClickFilter)
    frames: list[torch.Tensor] = field(default_factory=list)
    produced: int = 0
    left: bool = False
    """The request has left the batch (ended, cancelled, timed out): a step queued before it left
    is read without it."""


@dataclass
class _QueuedStep:
    """A step queued on the batch: its outputs on their way to the host, and the request of each
    item when it was queued."""

    pending: PendingStep
    slots: list[_Slot]


@dataclass
class EngineStats:
    """Counters the metrics read: steps run, sum of batch sizes over steps, prefills (requests
    prefilled whole), seconds and rows of prefill."""

    steps: int = 0
    occupied: int = 0
    prefills: int = 0
    prefill_seconds: float = 0.0
    prefill_rows: int = 0
    """Prompt rows the model prefilled (a cached voice prefix copied is not counted)."""


class Drama3Engine:
    """Continuous batching over one `Drama3ForSpeechGeneration`.

    Args:
        model: the model (eval mode, on its device).
        max_batch: requests decoded together (slots).
        max_queue: requests that may wait for a slot; `submit` raises `QueueFull` beyond it.
        prefill: how a job's first rows are prefilled: `prefill(model, job, rows) -> DecodeRun` of
            one item holding at least the first `rows` rows (default: `prefill_alone`); the engine
            prefills the rest a piece at a time.
        prefix_cache: a `prefix_cache.PrefixCache`: a job with a voice key (`SpeechJob.prefix`)
            starts from its voice's prefilled system turn; on a miss the system turn is prefilled
            a piece at a time like any rows, then cached.
        on_finish: called with (handle, outcome) when a request leaves ("eos", "length",
            "cancelled", "timeout", "error"): the metrics hook.
        capacity: columns (rows) each slot holds at first; the pool doubles when a request
            outgrows it.
        prefill_chunk: rows of prompt prefilled at most between two steps of the running requests
            (chunked prefill, `chunked_prefill`): a prompt is prefilled in pieces of at most this
            many rows, cut at rows that depend only on the prompt, so a running request waits at
            most one step and `prefill_chunk` rows of prefill between two frames.
        prefill_share: while requests run, the largest fraction of the scheduler's time prefill
            takes (0 < share <= 1): after a turn of prefill the running requests decode for
            (1 - share) / share times as long before the next one. 1.0 prefills between every
            two steps.
        compile_config: a transformers `CompileConfig` compiles the step (`draw` and `feed` in one
            graph) and steps the running requests in batch-size buckets (1, 2, 4, ... up to
            `max_batch`; the items past the running ones hold no request): with fixed shapes
            (`dynamic=False`) one graph per bucket and capacity; with torch's automatic dynamic
            shapes (`dynamic=None`, `default_compile_config`) the first bucket's graph, then one with
            the sizes that changed symbolic for the later buckets (batch 1 keeps its own). CUDA
            graphs record one graph per bucket (`mode="reduce-overhead"`). None
            (default) steps exactly the running requests eagerly. Phoneme alignment runs on both.
        audio_separator_token_id: the id of `<|audio_separator|>`: line-by-line prompts then draw
            it between their lines, as `generate(audio_separator_token_id=...)` does (None: no
            prompt speaks line by line).
        threads: CPU threads the scheduler decodes with: "auto" (default) chooses them from the
            model's size and the idle cores each time work arrives after an idle spell
            (`threads.decode_threads`); an int is used as given; None leaves torch's count alone.
        adapters: an `adapters.AdapterRegistry` on `model`: a job naming one of its adapters is
            prefilled and decoded with it (each batch item routes to its adapter's slot; the items
            of one step may all differ), and holds it until it ends.
    """

    def __init__(self, model, max_batch: int = 16, max_queue: int = 64, prefill=None, on_finish=None,
                 capacity: int = INITIAL_CAPACITY, threads: int | str | None = "auto", compile_config=None,
                 audio_separator_token_id: int | None = None, prefill_chunk: int = 512, adapters=None,
                 prefix_cache=None, prefill_share: float = DEFAULT_PREFILL_SHARE):
        check_threads(threads)
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}; expected at least 1")
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue}; expected 0 or more")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.overlong = overlong_factor(model)  # read once; a bad value is refused before any request
        self.alignment = resolve_alignment(model, [])  # the model's phoneme alignment, checked once
        self.compile_config = compile_config
        check_prefill_settings(prefill_chunk, prefill_share)
        self.prefill_chunk, self.prefill_share = prefill_chunk, prefill_share
        self._share = PrefillShare(prefill_share)
        self._turns = 0  # prefill turns taken: every OLDEST_EVERY-th starts with the oldest prompt
        self._prefilling: list[PromptPrefill] = []  # prompts prefilled a piece at a time, oldest first
        self.prefix_cache = prefix_cache
        self.separator_id = audio_separator_token_id
        if audio_separator_token_id is not None:  # refused here, before any request, when it is not a text token
            probe = torch.zeros(1, 2, dtype=torch.long)
            line_separators(model, probe, torch.ones_like(probe), audio_separator_token_id, torch.zeros(1))
        self._step_function = compiled_functions(compile_config).step
        self._guards = SteadyGuards()  # compiled: every guard only where the batch changed (`_arrange`, `_grow`)
        self.threads = threads
        self.prefill = prefill or prefill_alone
        self.adapters = adapters
        self.on_finish = on_finish
        self.stats = EngineStats()
        self._waiting: list[RequestHandle] = []
        self._slots: list[_Slot] = []
        self.capacity = capacity
        self._reset_batch()
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopped = False
        self._trim_pending = False

    # ---- the caller's side --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="drama3-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the scheduler; requests still waiting or running end with an ErrorEvent."""
        with self._lock:
            self._running, self._stopped = False, True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        prefilling = [prompt.handle for prompt in self._prefilling]
        self._prefilling = []
        for handle in [*self._waiting, *prefilling, *(slot.handle for slot in self._slots)]:
            self._finish(handle, "error", ErrorEvent("error", "the engine stopped"))
        self._waiting = []
        self._reset_batch()

    def submit(self, job: SpeechJob) -> RequestHandle:
        """Queue a job; raises `QueueFull` when `max_queue` jobs already wait. A job naming an
        adapter holds it from here (KeyError: the registry has no such adapter; see
        `AdapterRegistry.acquire`)."""
        seed = job.seed if job.seed is not None else secrets.randbelow(2**31)
        lease = self._lease(job)
        if lease is not None and job.prefix is not None:  # a voice prefix prefilled with this adapter, as loaded now
            job = replace(job, prefix=(job.prefix, lease.key))
        try:
            with self._lock:
                if self._stopped:
                    raise EngineStopped("the engine has stopped")
                if len(self._waiting) >= self.max_queue:
                    raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds {self.max_queue})")
                handle = RequestHandle(next(self._ids), job, seed)
                handle.lease = lease
                self._waiting.append(handle)
                self._lock.notify_all()
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return handle

    def _lease(self, job: SpeechJob):
        if job.adapter is None:
            return None
        if self.adapters is None:
            raise ValueError(f"adapter: {job.adapter!r} asked of an engine that serves no adapters")
        return self.adapters.acquire(job.adapter)

    def _routed(self, slots: torch.Tensor | None):
        """Forwards within route each item to its adapter's slot (nothing without adapters)."""
        return routed(slots) if self.adapters is not None else contextlib.nullcontext()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._slots)

    # ---- the scheduler ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                was_idle = self.idle
                while self._running and self.idle:
                    notified = self._lock.wait(timeout=IDLE_TRIM_DELAY if self._trim_pending else None)
                    if not notified and self._trim_pending and self.idle:
                        self._trim_pending = False  # what the requests' callers freed since goes back too
                        return_freed_memory()
                if not self._running:
                    return
            if was_idle:
                # torch keeps the thread count per thread: set it here, in the scheduler's own thread
                count = resolve_threads(self.model, self.threads)
                if count is not None:
                    torch.set_num_threads(count)
            self.step()

    def step(self) -> None:
        """Admit waiting requests into free slots, then advance the running batch by one frame.

        The scheduler thread calls this in a loop; without `start()` a caller may drive it."""
        try:
            with torch.no_grad():
                self._admit()
                if self._slots:
                    started = self._share.clock()
                    self._step()
                    self._share.decoded(self._share.clock() - started)
        except Exception as error:  # a failed step fails the requests it ran, not the server
            for slot in self._slots:
                self._finish(slot.handle, "error", ErrorEvent("error", f"{type(error).__name__}: {error}"))
            self._reset_batch()

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        return not self._waiting and not self._slots and not self._prefilling

    def _admit(self) -> None:
        """Drop waiting requests that were cancelled or ran out of time, then take a prefill turn
        unless the running requests are still owed decode time for the last one (`prefill_share`)."""
        self._drop_abandoned()
        running = bool(self._slots)
        if not self._share.may_prefill(running) or not (self._prefilling or self._waiting):
            return
        started = self._share.clock()
        if self._prefill_turn() and running:
            self._settle()
            self._share.prefilled(self._share.clock() - started, running)

    def _prefill_turn(self) -> int:
        """Prefill whole pieces of at most `prefill_chunk` rows in all (at least one piece): the
        prompt with the fewest rows left first (a waiting one, or one part prefilled), every
        OLDEST_EVERY-th turn the oldest first; prompts start only while the batch has room for them.
        Returns the rows prefilled."""
        self._turns += 1
        oldest_first = self._turns % OLDEST_EVERY == 0
        done = 0
        while True:
            prompt = self._next_prompt(oldest_first and not done)
            if prompt is None or (done and done + prompt.next_end(self.prefill_chunk) - prompt.filled > self.prefill_chunk):
                return done
            done += self._prefill_piece(prompt)

    def _next_prompt(self, oldest_first: bool) -> PromptPrefill | None:
        """The prompt whose piece comes next, started (taken from the waiting queue) if it was waiting."""
        with self._lock:
            waiting = list(self._waiting) if len(self._slots) + len(self._prefilling) < self.max_batch else []
        candidates = [*self._prefilling, *waiting]
        chosen = next_prompt(candidates, self._rows_left, lambda candidate: self._handle_of(candidate).id, oldest_first)
        if chosen is None or isinstance(chosen, PromptPrefill):
            return chosen
        return self._start(self._take(chosen))

    @staticmethod
    def _handle_of(candidate) -> RequestHandle:
        return candidate.handle if isinstance(candidate, PromptPrefill) else candidate

    def _rows_left(self, candidate) -> int:
        """Rows a prompt has left to prefill (a waiting one: all its rows; its cached prefix is not
        looked up before it starts)."""
        return candidate.left if isinstance(candidate, PromptPrefill) else candidate.job.input_ids.shape[1]

    def _take(self, handle: RequestHandle) -> RequestHandle:
        with self._lock:
            self._waiting.remove(handle)
        return handle

    def _start(self, handle: RequestHandle) -> PromptPrefill:
        """A waiting request starts its prefill: from its voice's cached system turn where the
        prefix cache has it, else from row 0 (its first piece is prefilled by `_prefill_piece`)."""
        job = handle.job
        prompt = PromptPrefill(handle, job.input_ids.shape[1], system_turn_boundary(job.input_ids, self.model.config.eos_token_id))
        if self.prefix_cache is not None and prompt.boundary:
            state = self.prefix_cache.lookup(self.model, job)
            if state is not None:
                prompt.run, prompt.from_prefix = state.run.copy(), True
        self._prefilling.append(prompt)
        return prompt

    def _prefill_piece(self, prompt: PromptPrefill) -> int:
        """Prefill the next piece of a prompt (joining the batch once it is whole; at the end of its
        system turn, caching it as its voice's prefix); the rows prefilled. A cancelled, timed-out
        or failed prompt is dropped (its handle ends)."""
        if self._dropped_if_abandoned(prompt):
            return 0
        handle, job = prompt.handle, prompt.handle.job
        done, end = prompt.filled, prompt.next_end(self.prefill_chunk)
        started = time.perf_counter()
        try:
            with self._routed(torch.tensor([handle.adapter_slot], device=self.model.device)):
                if prompt.run is None:
                    prompt.run = self.prefill(self.model, job, end)
                else:
                    prompt.run.extend(job.input_ids[:, done:end], job.audio_codes[:, done:end])
                if self._reached_uncached_prefix(prompt):
                    self.prefix_cache.store(job, prompt.run)
        except Exception as error:
            self._prefilling.remove(prompt)
            self._finish(handle, "error", ErrorEvent("error", f"{type(error).__name__}: {error}"))
            return end - done
        self.stats.prefill_seconds += time.perf_counter() - started
        self.stats.prefill_rows += prompt.filled - done
        self._join_if_prefilled(prompt)
        return prompt.filled - done

    def _reached_uncached_prefix(self, prompt: PromptPrefill) -> bool:
        return (self.prefix_cache is not None and prompt.handle.job.prefix is not None and not prompt.from_prefix
                and prompt.boundary and prompt.filled == prompt.boundary)

    def _settle(self) -> None:
        """Wait for the prefill queued on the device, so the clock times its work (CUDA)."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _dropped_if_abandoned(self, prompt: PromptPrefill) -> bool:
        """Drop a prompt in part prefilled whose request was cancelled or ran out of time."""
        handle = prompt.handle
        if not (handle.cancelled.is_set() or self._timed_out(handle)):
            return False
        self._prefilling.remove(prompt)
        kind = "cancelled" if handle.cancelled.is_set() else "timeout"
        self._finish(handle, kind, ErrorEvent(kind, f"the request was {'cancelled' if kind == 'cancelled' else 'past its time limit'}"))
        return True

    def _join_if_prefilled(self, prompt: PromptPrefill) -> None:
        """A prompt prefilled whole leaves the prefilling list and takes a slot of the batch."""
        if prompt.left:
            return
        self._prefilling.remove(prompt)
        try:
            slot = self._new_slot(prompt.handle)
        except Exception as error:
            self._finish(prompt.handle, "error", ErrorEvent("error", f"{type(error).__name__}: {error}"))
            return
        self.stats.prefills += 1
        self._join(prompt.run, slot)

    def _drop_abandoned(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        kept = []
        for handle in waiting:
            if handle.cancelled.is_set():
                self._finish(handle, "cancelled", ErrorEvent("cancelled", "the request was cancelled"))
            elif self._timed_out(handle):
                self._finish(handle, "timeout", ErrorEvent("timeout", "the request waited past its time limit"))
            else:
                kept.append(handle)
        with self._lock:
            self._waiting = kept + self._waiting
        for prompt in list(self._prefilling):
            self._dropped_if_abandoned(prompt)

    def _new_slot(self, handle: RequestHandle) -> _Slot:
        """The slot of a request: its job resolved as `generate()` resolves a batch of one (the one
        resolver, `decoding.request.resolve_request`), with `<|audio_separator|>` among its candidates
        wherever the engine speaks line by line (every item of the pool draws from the same ones)."""
        job = handle.job
        layout = {"speak_span": job.speak_span, "boundaries_left": job.boundaries_left}
        request = resolve_request(self.model, job.input_ids, torch.ones_like(job.input_ids), handle.options, layout,
                                  self.separator_id, self.alignment)
        if self.separator_id is not None:
            request = request.with_separator_candidate(self.separator_id)
        return _Slot(handle, request)

    # ---- the running batch: items of one DecodeState over the pool --------------------------------

    def _reset_batch(self) -> None:
        self._slots: list[_Slot] = []
        self._queued: _QueuedStep | None = None  # a step queued ahead, not read yet (CUDA)
        self._pool: DecodeCache | None = None
        self._state: DecodeState | None = None
        self._sampler: Drama3Sampler | None = None
        self._view: DecodeCache | None = None
        self._adapter_slots: torch.Tensor | None = None  # [items]: each item's adapter slot (0: base)

    def _join(self, run: DecodeRun, slot: _Slot) -> None:
        """Place a prefilled one-item run into the next free item of the pool."""
        rows = run.cache.backbone_part.filled
        if self._pool is None:
            capacity = self.capacity
            while capacity < rows + 1:
                capacity *= 2
            self._pool = DecodeCache.pool_like(run.cache, self.max_batch, capacity)
            if self.compile_config is not None:
                self._pool.mark_static()
        if self._pool.capacity < rows + 1:
            capacity = self._pool.capacity
            while capacity < rows + 1:
                capacity *= 2
            self._grow(capacity)  # one copy of the pool, however many doublings the prompt needs
        item = len(self._slots)
        self._pool.place(item, run.cache)
        state, request = run.state, slot.request
        device = state.ids.device
        separators_left = torch.zeros_like(state.separators_left) if request.separators is None else request.separators.left
        joining = DecodeState(
            state.hidden, state.ids, state.codes,
            torch.nn.functional.pad(state.key_mask, (0, self._pool.capacity - state.key_mask.shape[1])), state.position,
            torch.ones_like(state.active), torch.zeros_like(state.produced), request.budgets.to(device),
            separators_left.to(device), request.alignment,
        )
        joining_sampler = make_sampler(self.model, request)
        running, running_sampler = None, None
        if self._state is not None:
            items = list(range(item))
            running, running_sampler = self._state.select(items), self._sampler.select(items)
        slot.rows = rows
        self._slots.append(slot)
        if running is None:
            self._arrange(joining, joining_sampler)
        else:
            self._arrange(running.joined(joining), running_sampler.joined(joining_sampler))

    def _items(self) -> int:
        """Items a step runs: the running requests, or their batch-size bucket when compiled."""
        running = len(self._slots)
        if self.compile_config is None:
            return running
        return min(self.max_batch, 1 << max(0, (running - 1).bit_length()))

    def _arrange(self, running: DecodeState, sampler: Drama3Sampler) -> None:
        """The state, sampler and view of the running items (each request's sampler item carries its
        settings, key, step count and RAS window along), padded with items that hold no request up to
        the step's item count."""
        free = self._items() - running.batch
        if free:
            running = running.joined(self._free_state(free, running))
            sampler = sampler.padded(free)
        self._state = running
        self._pool.clear_items(len(self._slots))
        self._sampler = sampler
        self._view = None
        self._guards.reset()
        if self.adapters is not None:
            slots = [slot.handle.adapter_slot for slot in self._slots] + [0] * free
            self._adapter_slots = torch.tensor(slots, dtype=torch.long, device=running.ids.device)

    def _free_state(self, count: int, like: DecodeState) -> DecodeState:
        """Items that hold no request: inactive, one key (column 0) so no attention row is empty."""
        key_mask = torch.zeros(count, like.key_mask.shape[1], dtype=torch.bool, device=like.key_mask.device)
        key_mask[:, 0] = True
        zeros = torch.zeros(count, dtype=torch.long, device=like.ids.device)
        return DecodeState(
            like.hidden.new_zeros(count, *like.hidden.shape[1:]), like.ids.new_zeros(count, 1),
            like.codes.new_zeros(count, *like.codes.shape[1:]), key_mask, like.position.new_zeros(count, 1),
            torch.zeros(count, dtype=torch.bool, device=like.ids.device), zeros, zeros.clone(), zeros.clone(),
            None if like.alignment is None else like.alignment.blank(count),
        )

    def _grow(self, capacity: int | None = None) -> None:
        """Give every slot `capacity` columns (default: twice as many; one copy); the key masks
        widen with them."""
        self._pool.grow(capacity or 2 * self._pool.capacity)
        self._guards.reset()
        if self.compile_config is not None:
            self._pool.mark_static()
        if self._state is not None:
            missing = self._pool.capacity - self._state.key_mask.shape[1]
            self._state = replace(self._state, key_mask=torch.nn.functional.pad(self._state.key_mask, (0, missing)))
        self._view = None

    def _keep(self, kept: list[int]) -> None:
        """Keep the running items `kept` (ascending), moved up to the first items in that order."""
        for target, source in enumerate(kept):
            if source != target:
                self._pool.move(source, target)
        self._slots = [self._slots[item] for item in kept]
        if not kept:
            self._reset_batch_keeping_pool()
            return
        self._arrange(self._state.select(kept), self._sampler.select(kept))

    def _reset_batch_keeping_pool(self) -> None:
        """No request runs: keep the pool for the next one, unless a long prompt grew it past the
        capacity the engine starts with (its memory goes back; the next request allocates anew)."""
        pool = self._pool
        self._reset_batch()
        if pool is None or pool.capacity <= self.capacity:
            self._pool = pool
            return
        pool = None  # the grown pool's tensors are freed here; the C heap keeps their pages unless trimmed
        return_freed_memory()
        self._trim_pending = True  # and once more when the scheduler has been idle a moment (`_loop`)

    def _open_view(self, backbone_rows: int, tower_rows: int) -> DecodeCache:
        if self._pool.capacity < backbone_rows + 1:
            self._grow()
        if self._view is None:
            self._view = self._pool.head(self._state.batch)
        view = self._view
        view.backbone_part.filled, view.tower_part.filled = backbone_rows, tower_rows
        view.open_window(view.tower_part, 1)
        view.open_window(view.backbone_part, 1)
        return view

    def _compiled(self, function, *args):
        """`function(*args)`; compiled, its outputs copied out of CUDA-graph memory (the next
        replay reuses it)."""
        if self.compile_config is None:
            return function(*args)
        torch.compiler.cudagraph_mark_step_begin()
        return owned(self._guards(function, *args))

    def _step(self) -> None:
        """Read one step of the running batch: on CUDA (`runs_ahead`) the step queued at the last
        call, after queuing the next one, so the device makes a step while the scheduler sends the
        frames of the one before out; elsewhere a step made now. Finished requests leave."""
        queued = self._queued or self._queue_step()
        self._queued = self._queue_step() if runs_ahead(self._state.ids.device) else None
        self._read(queued)

    def _queue_step(self) -> _QueuedStep:
        """Queue one step of every item (`decoding.step.step`: the draw, then the feed of its row,
        one graph): it does not wait to know who ends, so a request that ends at this step has its
        row fed for nothing, and its item is given up with it."""
        model, slots = self.model, self._slots
        self.stats.steps += 1
        self.stats.occupied += len(slots)
        longest = max(slot.rows for slot in slots)
        view = self._open_view(longest, longest - 1)
        with self._routed(self._adapter_slots):
            output, self._state = self._compiled(self._step_function, model, view, self._sampler, self._state, self.separator_id)
        if self.compile_config is not None:
            own_drawn_state(self._sampler, self._state.alignment)
        for slot in slots:
            slot.rows += 1
        return _QueuedStep(PendingStep(self.stats.steps, output, self._state.active), list(slots))

    def _read(self, queued: _QueuedStep) -> None:
        """Send out what a queued step made for each request still in the batch; those that ended
        (or were cancelled, or ran out of time) leave."""
        step, _ = queued.pending.wait()
        some_left = False
        for item, slot in enumerate(queued.slots):
            if slot.left:
                continue  # it left after this step was queued: what the step made for its item is no one's
            self._advance(slot, step, item)
            if bool(step.ended[item]):
                self._end(slot, "eos" if bool(step.eos[item]) else "length")
            elif slot.handle.cancelled.is_set():
                self._finish(slot.handle, "cancelled", ErrorEvent("cancelled", "the request was cancelled"))
            elif self._timed_out(slot.handle):
                self._finish(slot.handle, "timeout", ErrorEvent("timeout", "the request ran past its time limit"))
            else:
                continue
            slot.left = some_left = True
        if some_left:
            self._keep([item for item, slot in enumerate(self._slots) if not slot.left])

    def state_of(self, handle: RequestHandle) -> tuple[DecodeState, list[torch.Tensor]] | None:
        """What a running request's item holds, or None when it is not running: its decode state
        (the open row's backbone output, masks, counters) and its cache (per attention layer, the
        keys and values of its rows, backbone then tower; per Gated DeltaNet layer, its conv and
        recurrent states): what a test compares with the request decoded alone."""
        for item, slot in enumerate(self._slots):
            if slot.handle is handle:
                return self._state.select([item]), self._pool.item_tensors(item, slot.rows)
        return None

    def _advance(self, slot: _Slot, step: FrameStep, row: int) -> None:
        """Send the frames this step made final for one request; note its line boundary."""
        slot.produced += int(step.produced[row])
        if bool(step.boundary[row]):
            slot.line_boundaries.append(slot.produced)
        released = slot.clicks.release(step, row)
        if released:
            frames = torch.stack(released).cpu()
            slot.frames.extend(frames)
            handle = slot.handle
            if handle.first_frame_at is None:
                handle.first_frame_at = time.perf_counter()
            handle.frames += frames.shape[0]
            handle.queue.put(FramesEvent(frames))

    def _end(self, slot: _Slot, reason: str) -> None:
        codes = torch.stack(slot.frames) if slot.frames else torch.zeros(0, self.model.config.num_codebooks, dtype=torch.long)
        request = slot.request
        expected_frames = float(request.expected_frames[0])
        anomalies = detect_anomalies(codes.shape[0], reason, expected_frames, int(request.guard_budgets[0]),
                                     overlong=self.overlong)
        self._finish(slot.handle, reason, DoneEvent(reason, codes, anomalies, int(request.budgets[0]), expected_frames,
                                                    slot.line_boundaries))

    def _timed_out(self, handle: RequestHandle) -> bool:
        timeout = handle.job.timeout
        return timeout is not None and time.perf_counter() - handle.submitted > timeout

    def _finish(self, handle: RequestHandle, outcome: str, event) -> None:
        handle.finished_at = time.perf_counter()
        if handle.lease is not None:
            handle.lease.release()
        handle.queue.put(event)
        if self.on_finish is not None:
            self.on_finish(handle, outcome)


@torch.no_grad()
def prefill_alone(model, job: SpeechJob, rows: int | None = None) -> DecodeRun:
    """Prefill one prompt on its own into a fresh cache: a one-item `DecodeRun` (no frames budgeted:
    the engine's pool holds its frames). `rows`: prefill only the first rows (at least 2) now; the
    engine extends the run with the others, a chunk per step."""
    end = job.input_ids.shape[1] if rows is None else max(2, rows)
    ids, codes = job.input_ids[:, :end], job.audio_codes[:, :end]
    return DecodeRun.prefilled(model, ids, codes, torch.ones_like(ids), None, torch.zeros(1, dtype=torch.long))
