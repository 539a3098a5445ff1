"""The voice-prefix cache: the prefilled state of a voice's prompt prefix, reused by every request.

In the published layout every request with the same references starts with the same rows: the
system turn up to its `<|im_end|>` (instructions, then each reference's transcript and frames), the
long part of a cloning prompt. The first request of a voice prefills those rows once; later ones
copy that state and prefill only their own rows after it (a chunked prefill: the Gated DeltaNet
layers continue from the cached recurrent and conv states, attention from the cached keys).

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

from ..decoding.loop import DecodeRun
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

    `prefill` is an engine's prefill function: jobs without a key, or whose rows do not start with
    the cached prefix, are prefilled alone (and refresh the entry)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def prefill(self, model, job: SpeechJob, rows: int | None = None) -> DecodeRun:
        """The job's prompt prefilled from its voice's cached prefix (its own rows up to `rows` of
        the prompt, at least one past the prefix; None: all of them)."""
        key = job.prefix
        shared = prefix_rows(model, job.input_ids) if key is not None else 0
        if not shared:
            return prefill_alone(model, job, rows)
        with self._lock:
            state = self.entries.get(key)
            if state is not None:
                self.entries.move_to_end(key)
        if state is None or not state.matches(job):
            self.misses += 1
            state = prefill_prefix(model, job.input_ids[:, :shared], job.audio_codes[:, :shared])
            with self._lock:
                self.entries[key] = state
                while len(self.entries) > self.capacity:
                    self.entries.popitem(last=False)
        else:
            self.hits += 1
        end = job.input_ids.shape[1] if rows is None else max(rows, state.rows + 1)
        return continue_prefill(model, state, job.input_ids[:, state.rows : end], job.audio_codes[:, state.rows : end])

    def forget(self, key) -> None:
        with self._lock:
            self.entries.pop(key, None)
