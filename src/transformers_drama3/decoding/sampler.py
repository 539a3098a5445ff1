"""Sampling: the sampler, the distribution it draws from, and its random numbers.

The sampler follows the published serving code (spec §5): temperature before top-p; the main token
has no top-k by default and keeps the token that crosses top-p (so eos stays reachable); the
codebook heads cap top-k at 30 and drop the crossing token; rank 0 is always kept. RAS: when the
first draw is a semantic token that repeats one of the last 16 main tokens (prompt rows
included), a second draw at temperature 1.0 / top-p 0.95 / top-k 30 replaces it. Both draws
always run, so the random stream of a request does not depend on its RAS window.

Randomness: a draw is an exponential race (argmax p_i / E_i with E_i ~ Exp(1), which picks i with
probability p_i) over the whole candidate set, whose numbers come from a counter-based generator
(`counter_noise`): item b's numbers are a function of its key (from its seed), its step and the
draw, computed inside the decode step. So an item draws the same numbers whatever else is in the
batch, and a compiled step holds its draws in its graph.

The settings themselves (`SamplingSettings`, the presets) are the option schema's sampling
entries (`decoding.options`), checked there once for every door.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import fused_step
# The sampler's distribution lives beside its fused kernel (kernels/fused_step.py), its reference.
from ..kernels.fused_step import MIN_TEMPERATURE, filtered_probabilities  # noqa: F401
from .counter_noise import MAIN_STREAM, RAS_STREAM, codebook_stream, exponentials, random_keys, seed_keys
from .options import (  # noqa: F401  (the settings and presets, importable from here as before)
    CODEBOOK_TOP_K, PAPER_EVALUATION, PRESETS, SERVING_DEFAULTS, SamplingSettings,
)

# ----------------------------------------------------------------------------- published constants

RAS_WINDOW = 16
"""Main tokens (prompt rows included) a semantic draw is compared with."""
RAS_TEMPERATURE = 1.0
RAS_TOP_P = 0.95
RAS_TOP_K = 30
RAS_SETTINGS = SamplingSettings(temperature=RAS_TEMPERATURE, top_p=RAS_TOP_P, top_k=RAS_TOP_K)
"""How RAS draws a repeated semantic token again, whatever the request's settings."""
EMPTY_WINDOW_SLOT = -1
"""Fills the RAS window where a row is padding; equals no token id."""

# ----------------------------------------------------------------------------- the distribution


def distribution(logits: torch.Tensor, settings: SamplingSettings, top_k: int | None, keep_crossing: bool) -> torch.Tensor:
    """The distribution a draw with `settings` samples from: logits `[..., V]` -> probabilities
    `[..., V]` (float32), at most `top_k` candidates (the main token's `settings.top_k`, a codebook
    head's `settings.codebook_top_k`); `keep_crossing`: keep the token that crosses top-p (the main
    token) or drop it (the codebook heads), then `settings.min_p` (`min_p_filtered`). The
    reference: every candidate sorted."""
    return min_p_filtered(filtered_probabilities(logits, settings.temperature, top_k, settings.top_p, keep_crossing), settings.min_p)


def capped_distribution(logits: torch.Tensor, settings: SamplingSettings, top_k: int, keep_crossing: bool) -> torch.Tensor:
    """`distribution` of a draw capped at `top_k` candidates, sorting only those (the codebook heads
    and RAS: 30 of 4096); the same up to the order of exactly tied probabilities."""
    probabilities = fused_step.top_k_filtered_probabilities(logits, settings.temperature, top_k, settings.top_p, keep_crossing)
    return min_p_filtered(probabilities, settings.min_p)


def min_p_filtered(probabilities: torch.Tensor, min_p: float) -> torch.Tensor:
    """probabilities `[..., V]` without the candidates less likely than `min_p` times the likeliest
    one, renormalised; min_p 0: as they are (the same tensor, so a draw without min_p is unchanged).
    The likeliest candidate survives every filter before this one and the ratios to it are those of
    the softmax at the draw's temperature, so the filters before it only narrow what it keeps."""
    if not min_p:
        return probabilities
    kept = probabilities.masked_fill(probabilities < min_p * probabilities.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def race(probabilities: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`argmax p_i / E_i` over the last dimension: the draw of an exponential race over `noise`."""
    return (probabilities / noise).argmax(dim=-1)


def filtered_draw(logits: torch.Tensor, settings: SamplingSettings, top_k: int | None, keep_crossing: bool,
                  noise: torch.Tensor) -> torch.Tensor:
    """One draw with `settings` over logits `[rows, V]` and its numbers `noise` `[rows, V]` -> long
    `[rows]`; on CUDA a capped draw of the codebook heads' kind is one fused kernel over the same
    numbers (the kernel has no min-p: a draw with one takes the reference)."""
    if top_k is not None and not keep_crossing and not settings.min_p and fused_step.use_kernel(logits):
        return fused_step.filtered_race(logits, noise, settings.temperature, top_k, settings.top_p, keep_crossing)
    if top_k is None:
        return race(distribution(logits, settings, top_k, keep_crossing), noise)
    return race(capped_distribution(logits, settings, top_k, keep_crossing), noise)


# ----------------------------------------------------------------------------- the sampler


class Drama3Sampler:
    """Draws the main token and the codebook codes of each frame, and keeps the RAS window.

    Args:
        settings: the sampling settings of every item, or one per item (a batch whose requests
            sample differently, as the serving engine's): items with equal settings draw together,
            each from its own numbers, so an item draws what it draws alone.
        candidate_ids: token ids of the restricted main logits: the semantic band, eos, then
            optionally `<|audio_separator|>`.
        window: `[batch, RAS_WINDOW]` the last main tokens of each prompt (`EMPTY_WINDOW_SLOT` where
            padding), oldest first.
        keys: long `[batch]`, each item's key (`item_keys`): the seed of its random numbers.
        codebook_size: size of the semantic band (default: all candidates but the last).
        main_widths: `[batch]` candidates item b may ever draw (default: all); an item that may not
            emit the separator draws as if it were not a candidate.
    """

    def __init__(
        self,
        settings: SamplingSettings | Sequence[SamplingSettings],
        candidate_ids: torch.Tensor,
        window: torch.Tensor,
        keys: torch.Tensor | None = None,
        codebook_size: int | None = None,
        main_widths: torch.Tensor | None = None,
    ):
        batch = window.shape[0]
        self.row_settings = [settings] * batch if isinstance(settings, SamplingSettings) else list(settings)
        if len(self.row_settings) != batch:
            raise ValueError(f"settings has {len(self.row_settings)} values for a batch of {batch}")
        self.candidate_ids = candidate_ids
        self.codebook_size = candidate_ids.shape[0] - 1 if codebook_size is None else codebook_size
        self.window = window
        self.keys = random_keys(batch, window.device) if keys is None else keys.to(window.device)
        if self.keys.shape != (batch,):
            raise ValueError(f"keys has shape {tuple(self.keys.shape)}; expected one key per item ({batch})")
        self.steps = torch.zeros(batch, dtype=torch.long, device=window.device)
        """The steps each item has drawn: the counter of its random numbers (`advance`)."""
        self.main_widths = main_widths
        self.ras_replacements = torch.zeros(batch, dtype=torch.long, device=window.device)
        self._grouped = self._group(window.device)  # here, not inside a compiled step: no constant in its graph

    @property
    def settings(self) -> SamplingSettings:
        """The settings of every item (a batch whose items sample alike)."""
        groups = self.groups()
        if len(groups) != 1:
            raise ValueError("this sampler's items sample differently: read row_settings")
        return groups[0][0]

    def groups(self) -> list[tuple[SamplingSettings, torch.Tensor | None]]:
        """(settings, the items that draw with them as a long tensor; None: every item)."""
        return [(settings, rows) for settings, rows, _ in self._grouped]

    def _group(self, device) -> list[tuple[SamplingSettings, torch.Tensor | None, list[int] | None]]:
        distinct = list(dict.fromkeys(self.row_settings))
        if len(distinct) <= 1:
            return [(distinct[0] if distinct else SamplingSettings(), None, None)]
        members = [[i for i, row in enumerate(self.row_settings) if row == each] for each in distinct]
        return [(each, torch.tensor(items, device=device), items) for each, items in zip(distinct, members)]

    def _per_group(self, batch_values: torch.Tensor, draw) -> torch.Tensor:
        """`draw(settings, pick, items)` for each group of items (`pick` selects a tensor's rows of
        the group, None stays None; `items` the group's item indices, None: every item), put back in
        item order."""
        if len(self._grouped) == 1:
            return draw(self._grouped[0][0], lambda tensor: tensor, None)
        out = torch.empty_like(batch_values)
        for settings, rows, items in self._grouped:
            out[rows] = draw(settings, lambda tensor, rows=rows: None if tensor is None else tensor[rows], items)
        return out

    def _rows_of(self, items: list[int]) -> torch.Tensor:
        return next(rows for _, rows, members in self._grouped if members is items)

    def main_token(
        self, logits: torch.Tensor, active: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Restricted main logits `[batch, 1, candidates]` -> main token ids `[batch, 1]`.

        `active` [batch]: the items still speaking (default: all); only their RAS replacements count
        (an item that ended keeps stepping with the batch, on rows nobody hears)."""
        logits = logits[:, -1]
        candidates = logits.shape[-1]
        counted = torch.zeros_like(self.ras_replacements)

        def draw(settings: SamplingSettings, pick, items) -> torch.Tensor:
            nonlocal counted
            group_logits = pick(logits)
            if not settings.do_sample:
                return group_logits.argmax(dim=-1)
            keys, steps, widths = pick(self.keys), pick(self.steps), pick(self.main_widths)
            first_noise = exponentials(keys, steps, MAIN_STREAM, candidates, widths)
            choice = filtered_draw(group_logits, settings, settings.top_k, True, first_noise)
            if not settings.repetition_aware:
                return choice
            second_noise = exponentials(keys, steps, RAS_STREAM, candidates, widths)
            second = filtered_draw(group_logits, RAS_SETTINGS, RAS_TOP_K, True, second_noise)
            first_ids = self.candidate_ids[choice]
            repeats = (pick(self.window) == first_ids[:, None]).any(dim=-1) & (choice < self.codebook_size)
            replaced = repeats if active is None else repeats & pick(active)
            counted = counted + replaced.long() if items is None else counted.index_put((self._rows_of(items),), replaced.long())
            return torch.where(repeats, second, choice)

        choice = self._per_group(logits[:, 0].long(), draw)
        self.ras_replacements = self.ras_replacements + counted  # out of place: a graph input stays unmutated
        main_ids = self.candidate_ids[choice]
        self.window = torch.cat((self.window[:, 1:], main_ids[:, None]), dim=1)
        return main_ids[:, None]

    def codebook(self, logits: torch.Tensor, codebook_index: int) -> torch.Tensor:
        """Head logits `[batch, 1, codebook_size]` -> codes `[batch, 1]` (the same settings for
        every head of an item). An item that makes no frame draws a meaningless code."""
        logits = logits[:, -1]

        def draw(settings: SamplingSettings, pick, items) -> torch.Tensor:
            head = pick(logits)
            if not settings.do_sample:
                return head.argmax(dim=-1)
            noise = exponentials(pick(self.keys), pick(self.steps), codebook_stream(codebook_index), head.shape[-1])
            return filtered_draw(head, settings, settings.codebook_top_k, False, noise)

        return self._per_group(logits[:, 0].long(), draw)[:, None]

    def advance(self) -> None:
        """Every item has drawn its step: the next draws take the next numbers (out of place, so a
        compiled step's input stays unmutated)."""
        self.steps = self.steps + 1

    def owned(self) -> None:
        """Copy out the tensors a compiled draw replaced (the RAS window, the counters): they live
        in CUDA-graph memory the next replay overwrites."""
        self.window, self.ras_replacements, self.steps = self.window.clone(), self.ras_replacements.clone(), self.steps.clone()

    def select(self, items: Sequence[int]) -> Drama3Sampler:
        """The sampler of `items` (their settings, RAS windows, keys, step counts, candidate widths
        and RAS counts), in that order: what a batch keeps of its items when others leave."""
        index = torch.tensor(list(items), dtype=torch.long, device=self.window.device)
        return self._of_parts(
            [self.row_settings[item] for item in items], self.window[index], self.keys[index], self.steps[index],
            None if self.main_widths is None else self.main_widths[index], self.ras_replacements[index],
        )

    def joined(self, other: Drama3Sampler) -> Drama3Sampler:
        """This sampler's items, then `other`'s (the same candidates): a batch that an item joins."""
        if self.candidate_ids.shape != other.candidate_ids.shape:  # the shape: comparing the ids would wait for the device
            raise ValueError("joined samplers draw from different candidates")
        widths = None
        if self.main_widths is not None or other.main_widths is not None:
            widths = torch.cat((self._widths(), other._widths().to(self.window.device)))
        device = self.window.device
        return self._of_parts(
            self.row_settings + other.row_settings, torch.cat((self.window, other.window.to(device))),
            torch.cat((self.keys, other.keys.to(device))), torch.cat((self.steps, other.steps.to(device))), widths,
            torch.cat((self.ras_replacements, other.ras_replacements.to(device))),
        )

    def padded(self, count: int) -> Drama3Sampler:
        """This sampler's items, then `count` items that hold no request (their draws are read by no
        one): the first item's settings, so they draw in its group, an empty window, key 0, no
        `<|audio_separator|>`."""
        device = self.window.device
        zeros = torch.zeros(count, dtype=torch.long, device=device)
        free = self._of_parts(
            [self.row_settings[0]] * count, torch.full((count, self.window.shape[1]), EMPTY_WINDOW_SLOT, dtype=torch.long,
                                                      device=device),
            zeros, zeros.clone(), None if self.main_widths is None else torch.full_like(zeros, self.codebook_size + 1),
            zeros.clone(),
        )
        return self.joined(free)

    def _widths(self) -> torch.Tensor:
        if self.main_widths is not None:
            return self.main_widths
        return torch.full_like(self.keys, self.candidate_ids.shape[0])

    def _of_parts(self, settings, window, keys, steps, widths, ras_replacements) -> Drama3Sampler:
        sampler = Drama3Sampler(settings, self.candidate_ids, window, keys, self.codebook_size, widths)
        sampler.steps, sampler.ras_replacements = steps, ras_replacements
        return sampler


def prompt_window(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The RAS window of each prompt: its last `RAS_WINDOW` main tokens, `EMPTY_WINDOW_SLOT` on
    padding (and before the prompt's first row). `[batch, rows]` -> `[batch, RAS_WINDOW]`."""
    window = input_ids.masked_fill(~attention_mask.bool(), EMPTY_WINDOW_SLOT)[:, -RAS_WINDOW:]
    missing = RAS_WINDOW - window.shape[1]
    return torch.nn.functional.pad(window, (missing, 0), value=EMPTY_WINDOW_SLOT)


SEED_STRIDE = 1_000_003
"""Seeds of two seeded runs that must not share draws lie this far apart (attempt n of a request
draws with seed + n * SEED_STRIDE, GRPO step n with n * SEED_STRIDE): a prime above any batch."""


def item_seeds(seed: int | Sequence[int], batch: int) -> list[int]:
    """The seed of each item of a batch: an int gives item b the seed `seed + b`, a list one each."""
    return [seed + index for index in range(batch)] if isinstance(seed, int) else list(seed)


def item_keys(seed: int | Sequence[int] | None, batch: int, device: torch.device) -> torch.Tensor:
    """The key of each item's random numbers, long `[batch]`: from `item_seeds(seed, batch)`, or
    random keys (torch's global generator) without a seed."""
    if seed is None:
        return random_keys(batch, device)
    seeds = item_seeds(seed, batch)
    if len(seeds) != batch:
        raise ValueError(f"seed has {len(seeds)} values for a batch of {batch}; expected one per item or an int")
    return seed_keys(seeds, device)
