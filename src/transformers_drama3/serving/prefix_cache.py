"""The voice-prefix cache: the prefilled state of a voice's prompt prefix, reused by every request.

In the published layout every request with the same references starts with the same rows: the
system turn up to its `<|im_end|>` (instructions, then each reference's transcript and frames), the
long part of a cloning prompt. The first request of a voice prefills those rows once; later ones
copy that state and prefill only their own rows after it (a chunked prefill: the Gated DeltaNet
layers continue from the cached recurrent and conv states, attention from the cached keys).

The engine asks `lookup` when a request starts and, on a miss, prefills the system turn a piece at
a time like any other rows (`chunked_prefill`), then hands the state at its end to `store`: a voice
with long references never stalls the running requests for its whole system turn. `prefill` does
the same in one call, for a caller outside the engine.

A continued prefill computes the same function as a prefill of the whole prompt, in a different
order of floating-point operations, so its outputs match the whole prefill to float tolerance,
not bitwise; a request's codes are still the same alone or in a busy batch, since the cache is
used alike in both.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..decoding import DecodeRun
from ..prompting.bare_rows import system_turn_rows
from .engine import SpeechJob, prefill_alone


@dataclass
class PrefixState:
    """The state after the prefix rows input_ids [1, P] / audio_codes [1, P, C]: a one-item
    `DecodeRun` prefilled with them (P backbone rows, P - 1 tower rows, row P - 1 open)."""

    input_ids: torch.Tensor
    audio_codes: torch.Tensor
    run: DecodeRun

    @property
    def rows(self) -> int:
        return self.input_ids.shape[1]

    def matches(self, job: SpeechJob) -> bool:
        rows = self.rows
        return (
            job.input_ids.shape[1] > rows
            and torch.equal(job.input_ids[:, :rows], self.input_ids)
            and torch.equal(job.audio_codes[:, :rows], self.audio_codes)
        )


def prefix_rows(model, input_ids: torch.Tensor) -> int:
    """Rows of the shareable prefix of a prompt [1, rows]: its system turn
    (`prompting.bare_rows.system_turn_rows`); 0 when there is nothing to share."""
    return system_turn_rows(input_ids, model.config.eos_token_id)


@torch.no_grad()
def prefill_prefix(model, input_ids: torch.Tensor, audio_codes: torch.Tensor) -> PrefixState:
    """Prefill prefix rows [1, P] into a fresh cache."""
    run = DecodeRun.prefilled(model, input_ids, audio_codes, torch.ones_like(input_ids), None, torch.zeros(1, dtype=torch.long))
    return PrefixState(input_ids, audio_codes, run)


@torch.no_grad()
def continue_prefill(model, prefix: PrefixState, input_ids: torch.Tensor, audio_codes: torch.Tensor) -> DecodeRun:
    """Prefill the rows after a prefix, input_ids [1, S] / audio_codes [1, S, C], into a copy of its
    run: the state `prefill_alone` leaves for the whole prompt (P + S backbone rows, P + S - 1 tower
    rows, the last row open), up to float rounding."""
    run = prefix.run.copy()
    run.extend(input_ids, audio_codes)
    return run


class PrefixCache:
    """Prefix states by voice (`job.prefix`, a hashable key), the most recently used `capacity` kept.

    `lookup` / `store` serve the engine, which prefills a missing prefix a piece at a time;
    `prefill` prefills a job in one call from its voice's cached prefix (a prefix missing or
    changed is prefilled whole and stored)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def lookup(self, model, job: SpeechJob) -> PrefixState | None:
        """The cached prefix state of the job's voice when the job's rows start with it (a hit),
        else None (a miss, counted); None without counting for a job with no key or no system turn."""
        if job.prefix is None or not prefix_rows(model, job.input_ids):
            return None
        with self._lock:
            state = self.entries.get(job.prefix)
            if state is not None:
                self.entries.move_to_end(job.prefix)
        if state is None or not state.matches(job):
            self.misses += 1
            return None
        self.hits += 1
        return state

    def store(self, job: SpeechJob, run: DecodeRun) -> None:
        """Keep a copy of `run`, the job's prompt prefilled up to the end of its system turn (exactly),
        as its voice's prefix (the least recently used entry goes past `capacity`)."""
        rows = run.cache.backbone_part.filled
        if job.prefix is None or rows != prefix_rows(run.model, job.input_ids):
            raise ValueError(f"a run of {rows} rows is not the system turn of the job's prompt")
        state = PrefixState(job.input_ids[:, :rows], job.audio_codes[:, :rows], run.copy())
        with self._lock:
            self.entries[job.prefix] = state
            self.entries.move_to_end(job.prefix)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)

    def prefill(self, model, job: SpeechJob, rows: int | None = None) -> DecodeRun:
        """The job's prompt prefilled from its voice's cached prefix (its own rows up to `rows` of
        the prompt, at least one past the prefix; None: all of them)."""
        shared = prefix_rows(model, job.input_ids) if job.prefix is not None else 0
        if not shared:
            return prefill_alone(model, job, rows)
        state = self.lookup(model, job)
        if state is None:
            state = prefill_prefix(model, job.input_ids[:, :shared], job.audio_codes[:, :shared])
            self.store(job, state.run)
        end = job.input_ids.shape[1] if rows is None else max(rows, state.rows + 1)
        return continue_prefill(model, state, job.input_ids[:, state.rows : end], job.audio_codes[:, state.rows : end])

    def forget(self, key) -> None:
        with self._lock:
            self.entries.pop(key, None)
