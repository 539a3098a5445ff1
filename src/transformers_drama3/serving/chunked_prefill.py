"""Chunked prefill: which prompts the engine prefills between two decode steps, in which pieces,
and how much of the scheduler's time prefill may take while requests run.

Pieces. A prompt is prefilled in pieces of at most `chunk` rows, cut at rows that depend only on
the prompt: from row 0 to the end of its system turn (the voice prefix every request of a voice
shares) in pieces of `chunk`, then from there to the end in pieces of `chunk`. So a request's
prefill is the same sequence of forwards alone or beside others, and with the voice-prefix cache
warm, cold or off (a warm cache hands it the state at the system turn's end, which a cold one
reaches through the same pieces): its codes do not depend on what else runs.

Turns. Between two decode steps of the running requests the engine prefills whole pieces of at
most `chunk` rows in all (at least one piece): the pieces of the prompts with the fewest rows left
first (a short request does not wait behind a long prompt that came before it), except that every
`OLDEST_EVERY`-th turn starts with the oldest prompt's piece (a run of short requests cannot starve
a long one). A running request therefore waits at most one turn (`chunk` rows) between two frames.

Share. A turn of `chunk` rows may cost many decode steps (on a CPU, prefill is compute-bound), so
while requests run, prefill may take at most `share` of the scheduler's time: after a turn that took
t seconds, the running requests take decode steps for t * (1 - share) / share seconds before the
next turn (`PrefillShare`). Their frame rate stays at least `1 - share` of what it is without
prompts to prefill; with none running, turns follow each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..prompting.bare_rows import system_turn_rows

OLDEST_EVERY = 4
"""Every fourth prefill turn starts with the oldest prompt waiting or in part prefilled."""

DEFAULT_PREFILL_SHARE = 0.5
"""While requests run, prefill takes at most half of the scheduler's time by default."""


def check_prefill_settings(chunk: int, share: float) -> None:
    """Refuse a piece size under 2 rows (a prompt's first piece holds a backbone row and a tower
    row) and a share outside (0, 1]."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
        raise ValueError(f"prefill_chunk={chunk!r}; expected at least 2 rows")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
        raise ValueError(f"prefill_share={share!r}; expected a fraction in (0, 1] of the scheduler's time")


def piece_end(filled: int, rows: int, boundary: int, chunk: int) -> int:
    """The row (exclusive) the next piece of a prompt of `rows` rows ends at, `filled` rows in:
    pieces of `chunk` rows from row 0 up to `boundary` (the end of the system turn; 0: none), then
    of `chunk` rows from `boundary` on. The first piece holds at least 2 rows."""
    if filled >= rows:
        raise ValueError(f"the prompt's {rows} rows are all prefilled")
    start, stop = (0, boundary) if filled < boundary else (boundary, rows)
    end = min(stop, start + ((filled - start) // chunk + 1) * chunk)
    return max(end, min(2, rows)) if filled == 0 else end


def system_turn_boundary(input_ids: torch.Tensor, im_end_id: int) -> int:
    """Where a prompt [1, rows]'s pieces are cut besides every `chunk` rows: the end of its system
    turn (`prompting.bare_rows.system_turn_rows`), 0 when it has none or nothing follows it."""
    rows = system_turn_rows(input_ids, im_end_id)
    return rows if 2 <= rows < input_ids.shape[1] else 0


@dataclass
class PromptPrefill:
    """A prompt being prefilled: its request's handle, its rows, where its pieces are cut
    (`boundary`), the one-item `DecodeRun` prefilled so far (None before its first piece) and
    whether that run started from a cached voice prefix."""

    handle: object
    rows: int
    boundary: int
    run: object | None = None
    from_prefix: bool = False

    @property
    def filled(self) -> int:
        return 0 if self.run is None else self.run.cache.backbone_part.filled

    @property
    def left(self) -> int:
        return self.rows - self.filled

    def next_end(self, chunk: int) -> int:
        return piece_end(self.filled, self.rows, self.boundary, chunk)


def next_prompt(candidates: Sequence, rows_left: Callable[[object], int], age: Callable[[object], int],
                oldest_first: bool):
    """The prompt whose piece comes next among `candidates` (prompts in part prefilled, and waiting
    requests that may start): the oldest (`age`: lower is older) when `oldest_first`, else the one
    with the fewest rows left, the oldest among equals; None when there is none."""
    if not candidates:
        return None
    if oldest_first:
        return min(candidates, key=age)
    return min(candidates, key=lambda candidate: (rows_left(candidate), age(candidate)))


class PrefillShare:
    """How much of the scheduler's time prefill may take while requests run (see the module
    docstring): a turn taken beside running requests leaves a debt of decode time that their steps
    pay before the next turn. `clock` reads seconds (a test may count work instead)."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter):
        self.share, self.clock = share, clock
        self.debt = 0.0

    def may_prefill(self, running: bool) -> bool:
        """Whether a prefill turn may run now; with no request running the debt is forgiven."""
        if not running:
            self.debt = 0.0
        return self.debt <= 0.0

    def prefilled(self, seconds: float, running: bool) -> None:
        """A turn took `seconds`; beside running requests, they are owed decode time for it."""
        if running:
            self.debt += seconds * (1.0 - self.share) / self.share

    def decoded(self, seconds: float) -> None:
        """A decode step took `seconds`."""
        self.debt = max(0.0, self.debt - seconds)
