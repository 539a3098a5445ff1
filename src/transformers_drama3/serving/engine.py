"""A continuous-batching engine: one model, one scheduler thread, many requests decoded together.

    engine = Drama3Engine(model, max_batch=16)
    engine.start()
    handle = engine.submit(SpeechJob(input_ids, audio_codes, settings, seed=7))
    for event in handle.events():      # FramesEvent ..., then DoneEvent (or ErrorEvent)
        ...
    engine.stop()

Each scheduler step advances every running request by one frame, the way `generate()`'s decode
loop advances a static batch: main token from the restricted lm_head logits (with RAS), codes
1..9 from the tower, then the frame goes back through the backbone. Between steps, a finished,
failed or cancelled request leaves the batch at once and frees its slot, and waiting requests are
prefilled alone (the prefill/decode split) and join the batch (see `slots.SlotBatch`).

Each request keeps its own sampler: its own settings, RAS window and `torch.Generator` (seeded as
`generate(seed=s)` seeds a batch of one), so what a request draws never depends on what else runs:
a request's codes with a given seed are the ones `generate()` gives it alone, whether it runs
alone or joins a busy batch mid-flight. Budgets and guards are `generate()`'s.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from .decoding import (
    AlignmentTracker,
    ClickFilter,
    Drama3Cache,
    Drama3Sampler,
    FrameStep,
    SamplingSettings,
    detect_anomalies,
    draw_within,
    expected_seconds_of_tokens,
    frame_budgets,
    item_generators,
    overlong_factor,
    prompt_window,
    resolve_alignment,
    slot_tower_step,
    target_text_tokens,
    text_tokens_per_second,
    turn_token_ids,
)
from ..decoding.threads import check_threads, resolve_threads
from .slot_pool import SlotPool
from .slots import SlotBatch


def compact_batch(max_batch: int) -> SlotBatch:
    """The plain reference state: one growing `Drama3Cache`, re-padded when a request joins."""
    return SlotBatch.empty()


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
    """

    input_ids: torch.Tensor
    audio_codes: torch.Tensor
    settings: SamplingSettings = SamplingSettings()
    seed: int | None = None
    max_new_tokens: int | None = None
    timeout: float | None = None
    prefix: object | None = None


@dataclass
class FramesEvent:
    """Frames [frames, num_codebooks] that are final (a click frame before eos is never sent)."""

    frames: torch.Tensor


@dataclass
class DoneEvent:
    """The request ended: finish_reason "eos" or "length"; codes [frames, num_codebooks] the whole
    take; anomalies: the guard findings on the codes (`detect_anomalies` without a waveform)."""

    finish_reason: str
    codes: torch.Tensor
    anomalies: list[str]
    budget: int
    expected_frames: float


@dataclass
class ErrorEvent:
    """The request failed or was cancelled; `kind` is "cancelled", "timeout" or "error"."""

    kind: str
    message: str


class RequestHandle:
    """The caller's side of a request: events arrive on `queue`; `cancel()` ends it at the next step."""

    def __init__(self, request_id: int, job: SpeechJob, seed: int):
        self.id, self.job, self.seed = request_id, job, seed
        self.queue: queue.Queue = queue.Queue()
        self.submitted = time.perf_counter()
        self.first_frame_at: float | None = None
        self.finished_at: float | None = None
        self.frames = 0
        self.cancelled = threading.Event()

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
    """A running request: its handle, sampler, budgets, click filter and frames so far."""

    handle: RequestHandle
    sampler: Drama3Sampler
    budget: int
    guard_budget: int
    expected_frames: float
    clicks: ClickFilter = field(default_factory=ClickFilter)
    frames: list[torch.Tensor] = field(default_factory=list)
    produced: int = 0
    aligner: AlignmentTracker | None = None


@dataclass
class EngineStats:
    """Counters the metrics read: steps run, sum of batch sizes over steps, prefills."""

    steps: int = 0
    occupied: int = 0
    prefills: int = 0
    prefill_seconds: float = 0.0


class Drama3Engine:
    """Continuous batching over one `Drama3ForSpeechGeneration`.

    Args:
        model: the model (eval mode, on its device).
        max_batch: requests decoded together (slots).
        max_queue: requests that may wait for a slot; `submit` raises `QueueFull` beyond it.
        prefill: how a job's prompt is prefilled: `prefill(model, job) -> SlotBatch` of one row
            (default: `prefill_alone`; `prefix_cache.PrefixCache.prefill` reuses voice prefixes).
        on_finish: called with (handle, outcome) when a request leaves ("eos", "length",
            "cancelled", "timeout", "error"): the metrics hook.
        batch_state: `batch_state(max_batch)` makes the running batch's state: `SlotPool`
            (default: preallocated slots written in place) or `compact_batch` (the plain
            reference: one growing cache, re-padded when a request joins).
        threads: CPU threads the scheduler decodes with: "auto" (default) chooses them from the
            model's size and the idle cores each time work arrives after an idle spell
            (`threads.decode_threads`); an int is used as given; None leaves torch's count alone.
    """

    def __init__(self, model, max_batch: int = 16, max_queue: int = 64, prefill=None, on_finish=None,
                 batch_state=None, threads: int | str | None = "auto"):
        check_threads(threads)
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}; expected at least 1")
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue}; expected 0 or more")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.overlong = overlong_factor(model)  # read once; a bad value is refused before any request
        self.alignment = resolve_alignment(model, [])  # the model's phoneme alignment, checked once
        self.threads = threads
        self.prefill = prefill or prefill_alone
        self.on_finish = on_finish
        self.stats = EngineStats()
        self._waiting: list[RequestHandle] = []
        self._slots: list[_Slot] = []
        self._batch_state = batch_state or SlotPool
        self._batch = self._batch_state(max_batch)
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopped = False

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
        for handle in [*self._waiting, *(slot.handle for slot in self._slots)]:
            self._finish(handle, "error", ErrorEvent("error", "the engine stopped"))
        self._waiting, self._slots, self._batch = [], [], self._batch_state(self.max_batch)

    def submit(self, job: SpeechJob) -> RequestHandle:
        """Queue a job; raises `QueueFull` when `max_queue` jobs already wait."""
        seed = job.seed if job.seed is not None else secrets.randbelow(2**31)
        with self._lock:
            if self._stopped:
                raise EngineStopped("the engine has stopped")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds {self.max_queue})")
            handle = RequestHandle(next(self._ids), job, seed)
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

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
                while self._running and not self._waiting and not self._slots:
                    self._lock.wait()
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
                    self._step()
        except Exception as error:  # a failed step fails the requests it ran, not the server
            for slot in self._slots:
                self._finish(slot.handle, "error", ErrorEvent("error", f"{type(error).__name__}: {error}"))
            self._slots, self._batch = [], self._batch_state(self.max_batch)

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        return not self._waiting and not self._slots

    def _admit(self) -> None:
        """Drop waiting requests that were cancelled or ran out of time, then prefill waiting
        requests (one at a time) into free slots."""
        self._drop_abandoned()
        while len(self._slots) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    return
                handle = self._waiting.pop(0)
            if handle.cancelled.is_set():
                self._finish(handle, "cancelled", ErrorEvent("cancelled", "the request was cancelled"))
                continue
            started = time.perf_counter()
            try:
                joining = self.prefill(self.model, handle.job)
                slot = self._new_slot(handle)
            except Exception as error:
                self._finish(handle, "error", ErrorEvent("error", f"{type(error).__name__}: {error}"))
                continue
            self.stats.prefills += 1
            self.stats.prefill_seconds += time.perf_counter() - started
            self._batch.join(joining)
            self._slots.append(slot)

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

    def _new_slot(self, handle: RequestHandle) -> _Slot:
        """The sampler, budgets and guards of a request, as `generate()` resolves them for a batch of one."""
        model, job = self.model, handle.job
        config = model.config
        ids = job.input_ids
        mask = torch.ones_like(ids)
        tokens = target_text_tokens(ids.cpu(), mask.cpu(), config.eos_token_id, model.is_semantic)
        seconds = expected_seconds_of_tokens(tokens, text_tokens_per_second(model))
        device = ids.device
        sampler = Drama3Sampler(
            job.settings, model.speech_token_ids(device), prompt_window(ids, mask),
            item_generators([handle.seed], 1, device),
        )
        return _Slot(
            handle=handle,
            sampler=sampler,
            budget=int(frame_budgets(seconds, config.frame_rate, job.max_new_tokens)[0]),
            guard_budget=int(frame_budgets(seconds, config.frame_rate)[0]),
            expected_frames=float(seconds[0] * config.frame_rate),
            aligner=None if self.alignment is None else AlignmentTracker(
                self.alignment, turn_token_ids(ids.cpu(), mask.cpu(), config.eos_token_id),
                config.codebook_size, [float(seconds[0] * config.frame_rate)],
            ),
        )

    def _step(self) -> None:
        """One frame for every running request; then finished requests leave and the rest decode their row."""
        model, batch, slots = self.model, self._batch, self._slots
        config = model.config
        self.stats.steps += 1
        self.stats.occupied += len(slots)
        logits = model.speech_logits(batch.hidden)  # [batch, 1, codebook_size + 1]
        main_ids = torch.cat([
            slot.sampler.main_token(logits[row : row + 1] if slot.aligner is None else slot.aligner.main_logits(logits[row : row + 1]))
            for row, slot in enumerate(slots)
        ])
        eos = main_ids[:, 0] == config.eos_token_id
        speaking = ~eos
        if bool(speaking.any()):
            semantic = (main_ids - config.semantic_start_token_id).clamp(0, config.codebook_size - 1)
            for row, slot in enumerate(slots):
                if slot.aligner is not None:
                    slot.aligner.observe(semantic[row], speaking[row : row + 1])

            def sample(head_logits, codebook_index):
                def one(row, slot):
                    drawing = speaking[row : row + 1]
                    return draw_within(slot.aligner, lambda head: slot.sampler.codebook(head, codebook_index, drawing),
                                       head_logits[row : row + 1], codebook_index, drawing)

                return torch.cat([one(row, slot) for row, slot in enumerate(slots)])

            frames = slot_tower_step(
                model, batch.hidden, batch.input_ids, batch.audio_codes, semantic, batch.mask, batch.cache.tower, sample
            )
        else:
            frames = batch.audio_codes.new_zeros(len(slots), 1, config.num_codebooks)
        produced = torch.tensor([slot.produced for slot in slots]) + speaking.long().cpu()
        budgets = torch.tensor([slot.budget for slot in slots])
        ended = eos.cpu() | (produced >= budgets)
        step = FrameStep(self.stats.steps, main_ids[:, 0], frames[:, 0], speaking.cpu(), ended, eos.cpu() & ended)
        kept = []
        for row, slot in enumerate(slots):
            self._advance(slot, step, row)
            if bool(ended[row]):
                self._end(slot, "eos" if bool(eos[row]) else "length")
            elif slot.handle.cancelled.is_set():
                self._finish(slot.handle, "cancelled", ErrorEvent("cancelled", "the request was cancelled"))
            elif self._timed_out(slot.handle):
                self._finish(slot.handle, "timeout", ErrorEvent("timeout", "the request ran past its time limit"))
            else:
                kept.append(row)
        self._slots = [slots[row] for row in kept]
        if len(kept) < len(slots):
            rows = torch.tensor(kept, dtype=torch.long, device=main_ids.device)
            batch.keep(rows)
            if not kept:
                return
            main_ids, frames = main_ids[rows], frames[rows]
        batch.open_row()
        hidden = model.decode_row(main_ids, frames, batch.mask, batch.cache)
        batch.set_current(hidden, main_ids, frames)

    def _advance(self, slot: _Slot, step: FrameStep, row: int) -> None:
        """Send the frames this step made final for one request."""
        slot.produced += int(step.produced[row])
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
        anomalies = detect_anomalies(codes.shape[0], reason, slot.expected_frames, slot.guard_budget,
                                     overlong=self.overlong)
        self._finish(slot.handle, reason, DoneEvent(reason, codes, anomalies, slot.budget, slot.expected_frames))

    def _timed_out(self, handle: RequestHandle) -> bool:
        timeout = handle.job.timeout
        return timeout is not None and time.perf_counter() - handle.submitted > timeout

    def _finish(self, handle: RequestHandle, outcome: str, event) -> None:
        handle.finished_at = time.perf_counter()
        handle.queue.put(event)
        if self.on_finish is not None:
            self.on_finish(handle, outcome)


@torch.no_grad()
def prefill_alone(model, job: SpeechJob) -> SlotBatch:
    """Prefill one prompt on its own into a fresh cache: a `SlotBatch` of one row."""
    cache = Drama3Cache.empty(model.config)
    mask = torch.ones_like(job.input_ids)
    hidden = model.prefill(job.input_ids, job.audio_codes, mask, cache)[:, -1:]
    return SlotBatch(cache, hidden, job.input_ids[:, -1:], job.audio_codes[:, -1:], mask)
