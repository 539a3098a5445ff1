"""Sampling: settings and presets, the one validator of sampling values, the sampler and its random numbers.

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

`check_sampling_values` is the one check of sampling values: `generate()`, the CLI, the HTTP
protocol and the demo all call it, so the same values are refused everywhere with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import GenerationConfig

from ..kernels import fused_step
# The sampler's distribution lives beside its fused kernel (kernels/fused_step.py), its reference.
from ..kernels.fused_step import MIN_TEMPERATURE, filtered_probabilities  # noqa: F401
from .budget import MAX_FRAMES
from .counter_noise import MAIN_STREAM, RAS_STREAM, codebook_stream, exponentials, random_keys, seed_keys

# ----------------------------------------------------------------------------- published constants

RAS_WINDOW = 16
"""Main tokens (prompt rows included) a semantic draw is compared with."""
RAS_TEMPERATURE = 1.0
RAS_TOP_P = 0.95
RAS_TOP_K = 30
CODEBOOK_TOP_K = 30
"""The codebook heads never keep more than this many candidates."""
EMPTY_WINDOW_SLOT = -1
"""Fills the RAS window where a row is padding; equals no token id."""

# ----------------------------------------------------------------------------- sampling settings


@dataclass(frozen=True)
class SamplingSettings:
    """How frames are drawn.

    Args:
        do_sample: False draws every token by argmax (no RAS).
        temperature: divides the logits before top-p, for the main token and the codebook heads.
        top_p: nucleus mass for the main token and the codebook heads (1.0: off).
        top_k: candidates kept for the main token (None: all); the codebook heads keep
            `min(top_k, 30)`.
        repetition_aware: apply RAS to the main token. A generation config may set it
            (`repetition_aware: false`): a model whose main tokens repeat by design, such as
            drama3-tiny's phonetic codes (one phoneme spans several frames), turns RAS off there.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int | None = None
    repetition_aware: bool = True

    @property
    def codebook_top_k(self) -> int:
        return CODEBOOK_TOP_K if self.top_k is None else min(self.top_k, CODEBOOK_TOP_K)


SERVING_DEFAULTS = SamplingSettings()
"""The published serving defaults: temperature 1.0, top-p 0.9, main token uncapped."""
PAPER_EVALUATION = SamplingSettings(temperature=0.7, top_p=0.7, top_k=30)
"""The paper's evaluation setting (temperature 0.7, top-p 0.7, top-k 30). Capping the main token
at 30 candidates makes takes without a reference go silent more often (spec §5)."""
PRESETS = {"serving": SERVING_DEFAULTS, "paper-eval": PAPER_EVALUATION}


def drama3_generation_config(config, **overrides) -> GenerationConfig:
    """A `GenerationConfig` holding the published serving defaults for a model with `config`.

    `max_new_tokens` is the hard cap of 4096 frames; each request is further capped by its own
    budget (see `frame_budgets`)."""
    values = dict(
        do_sample=SERVING_DEFAULTS.do_sample,
        temperature=SERVING_DEFAULTS.temperature,
        top_p=SERVING_DEFAULTS.top_p,
        max_new_tokens=MAX_FRAMES,
        eos_token_id=config.eos_token_id,
    )
    values.update(overrides)
    return GenerationConfig(**values)


_SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "repetition_aware")


def resolve_settings(
    model_config: GenerationConfig | None,
    preset: str | SamplingSettings | None,
    generation_config: GenerationConfig | None,
    overrides: dict,
) -> tuple[SamplingSettings, int | None, bool]:
    """Sampling settings, max_new_tokens and return_dict_in_generate of one call.

    Later sources win: the serving defaults, the model's generation config, the preset, the
    `generation_config` argument, then keyword arguments. Unset (None) values never override.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r}; expected one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    settings = SERVING_DEFAULTS
    values: dict = {}
    sources = [model_config, preset, generation_config, overrides]
    for source in sources:
        if source is None:
            continue
        if isinstance(source, SamplingSettings):
            settings = source  # the preset's sampling settings replace those read so far
            values = {key: value for key, value in values.items() if key not in _SAMPLING_KEYS}
            continue
        items = source if isinstance(source, dict) else source.to_dict()
        values.update({key: value for key, value in items.items() if value is not None})
    changes = {key: values[key] for key in _SAMPLING_KEYS if key in values}
    check_sampling_values({**changes, "max_new_tokens": values.get("max_new_tokens")})
    if "top_k" in changes and changes["top_k"] == 0:
        changes["top_k"] = None
    settings = replace(settings, **changes)
    if settings.do_sample and settings.temperature <= 0:
        settings = replace(settings, do_sample=False)
    return settings, values.get("max_new_tokens"), bool(values.get("return_dict_in_generate", False))


MAX_TEMPERATURE = 10.0
"""The highest temperature any entry point takes (past it every draw is near uniform noise)."""
MAX_TOP_K = 1_000_000
"""The highest top-k any entry point takes (beyond any vocabulary; 0 or None: no top-k)."""


def check_sampling_values(values: dict) -> None:
    """Refuse sampling values that would sample something else than asked (NaN, a top-p of 0) or
    generate anyway (a frame cap of 0). Reads `temperature`, `top_p`, `top_k`, `max_new_tokens`,
    `repetition_aware` and `do_sample` where present and not None; raises ValueError naming the
    field. Temperature 0 means greedy; top_k 0 means no top-k."""

    def number(name) -> bool:
        value = values.get(name)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for name in ("repetition_aware", "do_sample"):
        flag = values.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r}; expected True or False")
    if values.get("temperature") is not None and not (number("temperature") and 0 <= values["temperature"] <= MAX_TEMPERATURE):
        raise ValueError(f"temperature={values['temperature']!r}; expected a finite number in [0, {MAX_TEMPERATURE:g}] (0 is greedy)")
    if values.get("top_p") is not None and not (number("top_p") and 0 < values["top_p"] <= 1):
        raise ValueError(f"top_p={values['top_p']!r}; expected a value in (0, 1]")
    top_k = values.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K):
        raise ValueError(f"top_k={top_k!r}; expected an integer in [0, {MAX_TOP_K}] (0: no top-k)")
    frames = values.get("max_new_tokens")
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or not 0 < frames):
        raise ValueError(f"max_new_tokens={frames!r}; expected a positive number of frames")


# ----------------------------------------------------------------------------- the sampler


def race(probabilities: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`argmax p_i / E_i` over the last dimension: the draw of an exponential race over `noise`."""
    return (probabilities / noise).argmax(dim=-1)


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

    def _draw(self, logits, temperature, top_k, top_p, keep_crossing, noise):
        # A capped draw sorts only its top_k candidates (the codebook heads and RAS: 30 of 4096).
        if top_k is None:
            probabilities = filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
        else:
            probabilities = fused_step.top_k_filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
        return race(probabilities, noise)

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
            choice = self._draw(group_logits, settings.temperature, settings.top_k, settings.top_p, True, first_noise)
            if not settings.repetition_aware:
                return choice
            second_noise = exponentials(keys, steps, RAS_STREAM, candidates, widths)
            second = self._draw(group_logits, RAS_TEMPERATURE, RAS_TOP_K, RAS_TOP_P, True, second_noise)
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
            if fused_step.use_kernel(head):  # one fused kernel for the filtered draw, over the same numbers
                return fused_step.filtered_race(head, noise, settings.temperature, settings.codebook_top_k, settings.top_p, False)
            return self._draw(head, settings.temperature, settings.codebook_top_k, settings.top_p, False, noise)

        return self._per_group(logits[:, 0].long(), draw)[:, None]

    def advance(self) -> None:
        """Every item has drawn its step: the next draws take the next numbers (out of place, so a
        compiled step's input stays unmutated)."""
        self.steps = self.steps + 1

    def owned(self) -> None:
        """Copy out the tensors a compiled draw replaced (the RAS window, the counters): they live
        in CUDA-graph memory the next replay overwrites."""
        self.window, self.ras_replacements, self.steps = self.window.clone(), self.ras_replacements.clone(), self.steps.clone()

    def item_state(self, item: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(window `[1, RAS_WINDOW]`, key `[1]`, steps `[1]`) of one item: what it carries into a
        sampler made anew (the serving engine's, when the batch changes)."""
        span = slice(item, item + 1)
        return self.window[span].clone(), self.keys[span].clone(), self.steps[span].clone()


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
