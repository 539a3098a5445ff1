"""Generation for Drama 3: the published sampler, the decode loop, guards and streaming.

One `generate()` call runs one prefill of the prompt rows, then one decode step per frame:

    main token   <- lm_head restricted to the semantic band + eos, drawn by the main-token sampler
                    (with repetition-aware sampling, RAS)
    codes 1..9   <- the tower, run once per frame, each code drawn by the codebook sampler
    next row     <- [main, c0..c9] fed back through partial codebook fusion

until every item has drawn eos or used its frame budget. The eos frame is dropped, and so is a
`<|semantic:0|>` frame right before eos (it decodes to a click after the trailing silence).

Line-by-line prompts (lines separated by `<|audio_separator|>` in the last user turn, see
docs/prompt_layouts.md) add `<|audio_separator|>` to the main candidates, once per line boundary
the prompt has left: drawing it makes no frame and draws no code, the separator goes back in as a
text row (zero codes), exactly where the training rows put their supervised separators, and the
frame index of the boundary is reported (`line_boundaries`), so the take splits per line.

The sampler follows the published serving code (spec §5): temperature before top-p; the main token
has no top-k by default and keeps the token that crosses top-p (so eos stays reachable); the
codebook heads cap top-k at 30 and drop the crossing token; rank 0 is always kept. RAS: when the
first draw is a semantic token that repeats one of the last 16 main tokens (prompt rows
included), a second draw at temperature 1.0 / top-p 0.95 / top-k 30 replaces it. Both draws
always run, so the random stream of a request does not depend on its RAS window.

Randomness: with `seed`, each item of a batch has its own `torch.Generator`, so an item draws the
same numbers whatever else is in the batch; a draw is an exponential race (argmax p_i / E_i with
E_i ~ Exp(1), which picks i with probability p_i) over the whole candidate set.

Static decoding (`cache_implementation="static"`): the same steps on preallocated caches with
fixed shapes, drawing each step's random numbers ahead in the order this loop draws them, so that
`torch.compile(fullgraph=True)` takes one step as one graph (`static_decoding.py`; this loop is its
reference).

Place among the modules: the model (`modeling_drama3`) imports this module and inherits
`generate`/`stream` from `Drama3GenerationMixin`; this module imports nothing from the model and
drives it through its incremental methods (`prefill`, `tower_step`, `decode_row`) on a
`Drama3Cache`; `static_decoding` sits below it. Long texts and scenes, which need the
processor, are spoken by `long_form`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import CompileConfig, GenerationConfig, GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.utils import ModelOutput

from .codec.streaming import stream_decode_windows
from .configuration_drama3 import Drama3Config
from .kernels import fused_step
# The sampler's distribution lives beside its fused kernel (kernels/fused_step.py), its reference.
from .kernels.fused_step import MIN_TEMPERATURE, filtered_probabilities
from .phoneme_alignment import CONFIG_KEY as ALIGNMENT_KEY
from .phoneme_alignment import AlignmentTracker, draw_within, resolve_alignment, turn_token_ids
from .prompting.text import is_cjk
from .static_decoding import (
    Drama3StaticCache,
    StaticDecodeState,
    check_cache_implementation,
    compiled_step,
    default_compile_config,
    restricted_main_logits,
    static_length,
)
from .threads import check_threads, resolve_threads, torch_threads

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

# ----------------------------------------------------------------------------- guards (paper §7, §9)

MAX_FRAMES = 4096
"""No take is longer (the paper's cap, ~190 s)."""
BUDGET_FACTOR = 2.5
"""A take may last at most this many times its expected duration (paper §7)."""
TOKENS_PER_SECOND = 3.0
"""Expected speaking rate in text tokens per second. Qwen's tokenizer spends ~1.3 tokens on an
English word (read at ~2.5 words/s) and ~0.7 on a Chinese character (read at ~4.5 chars/s), both
~3.2 tokens/s; 3.0 errs towards a longer expected duration, the safe side for a budget."""
WORDS_PER_SECOND = 2.5
"""Expected speaking rate of space-separated text (English and similar)."""
CJK_CHARACTERS_PER_SECOND = 4.5
"""Expected speaking rate of Chinese, Japanese and Korean characters."""
MIN_EXPECTED_SECONDS = 1.0
"""The expected duration of any text, however short (a word still takes a breath)."""
TOO_SHORT_FRACTION = 0.25
"""A take that ends (eos) before this fraction of its expected duration is too short."""
SILENCE_RMS = 10 ** (-50 / 20)
"""A waveform window whose RMS is below -50 dBFS is silence."""
SILENCE_WINDOW_SECONDS = 0.1
LONG_SILENCE_SECONDS = 3.0
"""A take with a silence longer than this inside it is anomalous (paper §9 "long silence")."""

ANOMALIES = ("silent", "too_short", "runaway", "long_silence", "overlong")


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
    _check_sampling_values(changes, values.get("max_new_tokens"))
    if "top_k" in changes and changes["top_k"] <= 0:
        changes["top_k"] = None
    settings = replace(settings, **changes)
    if settings.do_sample and settings.temperature <= 0:
        settings = replace(settings, do_sample=False)
    if not 0 < settings.top_p <= 1:
        raise ValueError(f"top_p={settings.top_p}; expected a value in (0, 1]")
    return settings, values.get("max_new_tokens"), bool(values.get("return_dict_in_generate", False))


def _check_sampling_values(changes: dict, max_new_tokens) -> None:
    """Refuse sampling values that would silently sample something else (NaN temperature) or
    generate anyway (a frame cap of 0). Temperature 0 means greedy; top_k <= 0 means no top-k."""
    repetition_aware = changes.get("repetition_aware")
    if repetition_aware is not None and not isinstance(repetition_aware, bool):
        raise ValueError(f"repetition_aware={repetition_aware!r}; expected True or False")
    temperature = changes.get("temperature")
    if temperature is not None and not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}; expected a finite number >= 0 (0 is greedy)")
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}; expected a positive number of frames")


# ----------------------------------------------------------------------------- the sampler


def exponential_race(
    probabilities: torch.Tensor,
    generators: Sequence[torch.Generator] | None,
    widths: torch.Tensor | None = None,
    drawing: torch.Tensor | None = None,
) -> torch.Tensor:
    """One index per row of `probabilities` `[batch, V]`, row b drawn with `generators[b]`
    (the global generator when None).

    With generators, row b draws only `widths[b]` numbers (default V; the candidates after them
    must have probability 0), and nothing at all where `drawing[b]` is False (its index is then
    meaningless). So what an item draws never depends on what else is in the batch."""
    return race(probabilities, race_noise(probabilities, generators, widths, drawing))


def race(probabilities: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`argmax p_i / E_i` over the last dimension: the draw of an exponential race over `noise`."""
    return (probabilities / noise).argmax(dim=-1)


def race_noise(
    probabilities: torch.Tensor,
    generators: Sequence[torch.Generator] | None,
    widths: torch.Tensor | None = None,
    drawing: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Exp(1) numbers `exponential_race` divides by, `[batch, V]` like `probabilities` (`inf`
    past an item's width, 1 where it does not draw)."""
    if generators is None:
        return torch.empty_like(probabilities).exponential_()
    size = probabilities.shape[-1]
    device = probabilities.device
    rows = []
    for item, generator in enumerate(generators):
        if drawing is not None and not bool(drawing[item]):
            rows.append(torch.ones(size, device=device))
            continue
        width = size if widths is None else int(widths[item])
        row = torch.empty(width, device=device).exponential_(generator=generator)
        rows.append(torch.cat((row, torch.full((size - width,), float("inf"), device=device))))
    return torch.stack(rows)


@dataclass
class StepNoise:
    """The numbers of one decode step, drawn ahead: main / ras `[batch, candidates]` (ras None
    without RAS), codebooks `[batch, num_codebooks - 1, codebook_size]`, and `marks`: each
    generator's state after the main draws (`Drama3Sampler.rewind` returns to it)."""

    main: torch.Tensor
    ras: torch.Tensor | None
    codebooks: torch.Tensor
    marks: list[torch.Tensor]


class Drama3Sampler:
    """Draws the main token and the codebook codes of each frame, and keeps the RAS window.

    Args:
        settings: the sampling settings.
        candidate_ids: token ids of the restricted main logits: the semantic band, eos, then
            optionally `<|audio_separator|>`.
        window: `[batch, RAS_WINDOW]` the last main tokens of each prompt (`EMPTY_WINDOW_SLOT` where
            padding), oldest first.
        generators: one per item, or None for torch's global generator.
        codebook_size: size of the semantic band (default: all candidates but the last).
        main_widths: `[batch]` candidates item b may ever draw (default: all); an item that may not
            emit the separator draws as if it were not a candidate.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        candidate_ids: torch.Tensor,
        window: torch.Tensor,
        generators: Sequence[torch.Generator] | None = None,
        codebook_size: int | None = None,
        main_widths: torch.Tensor | None = None,
    ):
        self.settings = settings
        self.candidate_ids = candidate_ids
        self.codebook_size = candidate_ids.shape[0] - 1 if codebook_size is None else codebook_size
        self.window = window
        self.generators = generators
        self.main_widths = main_widths
        self.ras_replacements = torch.zeros(window.shape[0], dtype=torch.long, device=window.device)

    def _draw(self, logits, temperature, top_k, top_p, keep_crossing, widths=None, drawing=None, noise=None):
        # A capped draw sorts only its top_k candidates (the codebook heads and RAS: 30 of 4096).
        if top_k is None:
            probabilities = filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
        else:
            probabilities = fused_step.top_k_filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
        if noise is not None:
            return race(probabilities, noise)
        return exponential_race(probabilities, self.generators, widths, drawing)

    def main_token(
        self, logits: torch.Tensor, noise: StepNoise | None = None, active: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Restricted main logits `[batch, 1, candidates]` -> main token ids `[batch, 1]`.

        `noise`: the step's numbers drawn ahead (`step_noise`) instead of drawing them now;
        `active` [batch]: the items still speaking (default: all); only their RAS replacements count
        (an item that ended keeps stepping with the batch, on rows nobody hears)."""
        logits = logits[:, -1]
        settings = self.settings
        if not settings.do_sample:
            choice = logits.argmax(dim=-1)
        else:
            widths = self.main_widths
            first_noise, second_noise = (None, None) if noise is None else (noise.main, noise.ras)
            choice = self._draw(logits, settings.temperature, settings.top_k, settings.top_p, True, widths, noise=first_noise)
            if settings.repetition_aware:
                second = self._draw(logits, RAS_TEMPERATURE, RAS_TOP_K, RAS_TOP_P, True, widths, noise=second_noise)
                first_ids = self.candidate_ids[choice]
                repeats = (self.window == first_ids[:, None]).any(dim=-1) & (choice < self.codebook_size)
                counted = repeats if active is None else repeats & active
                self.ras_replacements = self.ras_replacements + counted.long()  # out of place: a graph input stays unmutated
                choice = torch.where(repeats, second, choice)
        main_ids = self.candidate_ids[choice]
        self.window = torch.cat((self.window[:, 1:], main_ids[:, None]), dim=1)
        return main_ids[:, None]

    def codebook(
        self, logits: torch.Tensor, codebook_index: int, drawing: torch.Tensor | None = None, noise: StepNoise | None = None
    ) -> torch.Tensor:
        """Head logits `[batch, 1, codebook_size]` -> codes `[batch, 1]` (same settings for every head).

        `drawing` [batch]: the items that make a frame now; the others draw nothing (their code is
        meaningless). `noise`: the step's numbers drawn ahead (`step_noise`)."""
        logits = logits[:, -1]
        settings = self.settings
        if not settings.do_sample:
            return logits.argmax(dim=-1)[:, None]
        given = None if noise is None else noise.codebooks[:, codebook_index - 1]
        if fused_step.use_kernel(logits):
            # one fused kernel for the filtered draw, over the noise the reference would divide by
            if given is None:
                given = race_noise(torch.empty(logits.shape, device=logits.device), self.generators, drawing=drawing)
            codes = fused_step.filtered_race(logits, given, settings.temperature, settings.codebook_top_k, settings.top_p, False)
            return codes[:, None]
        codes = self._draw(logits, settings.temperature, settings.codebook_top_k, settings.top_p, False, drawing=drawing, noise=given)
        return codes[:, None]

    # -- drawing a step's numbers ahead (the static decode step) ---------------------------------

    def step_noise(self, batch: int, candidates: int, num_codebooks: int, device: torch.device) -> StepNoise | None:
        """Every number one decode step may draw, drawn now, in the order the step would draw them:
        the main draw (and the RAS draw) over `candidates`, then one row of `codebook_size` per
        acoustic codebook, for every item. None when nothing is drawn (greedy).

        An item that then makes no frame would not have drawn its codebook numbers: `rewind`
        takes them back, so the generators end where a step that drew on demand leaves them."""
        if not self.settings.do_sample:
            return None
        shape = torch.empty(batch, candidates, device=device)
        main = race_noise(shape, self.generators, self.main_widths)
        ras = race_noise(shape, self.generators, self.main_widths) if self.settings.repetition_aware else None
        marks = [generator.get_state() for generator in self._generators_of(device)]
        row = torch.empty(batch, self.codebook_size, device=device)
        codebooks = torch.stack([race_noise(row, self.generators) for _ in range(num_codebooks - 1)], dim=1)
        return StepNoise(main, ras, codebooks, marks)

    def rewind(self, noise: StepNoise | None, speaking: torch.Tensor, boundary: torch.Tensor) -> None:
        """Take back the codebook numbers of `noise` that a step drawing on demand would not have
        drawn: per item, those of the items not `speaking` [batch]; with torch's global generator
        (one stream for the batch) all of them when no item made a frame or a boundary."""
        if noise is None:
            return
        generators = self._generators_of(speaking.device)
        if self.generators is None:
            if not bool((speaking | boundary).any()):
                generators[0].set_state(noise.marks[0])
            return
        for item in (~speaking).nonzero().flatten().tolist():
            generators[item].set_state(noise.marks[item])

    def _generators_of(self, device: torch.device) -> list[torch.Generator]:
        """The generators the draws use: one per item, or torch's global one for `device`."""
        if self.generators is not None:
            return list(self.generators)
        if device.type == "cuda":
            return [torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]]
        return [torch.default_generator]


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


def item_generators(seed: int | Sequence[int] | None, batch: int, device: torch.device) -> list[torch.Generator] | None:
    """One generator per item, seeded with `item_seeds(seed, batch)`; None without a seed."""
    if seed is None:
        return None
    seeds = item_seeds(seed, batch)
    if len(seeds) != batch:
        raise ValueError(f"seed has {len(seeds)} values for a batch of {batch}; expected one per item or an int")
    return [torch.Generator(device=device).manual_seed(int(value)) for value in seeds]


# ----------------------------------------------------------------------------- budgets and anomalies


def expected_seconds_of_text(text: str) -> float:
    """How long `text` takes to say: CJK characters at 4.5/s plus other words at 2.5/s, at least 1 s.

    Tags (`<|speaker:N|>`, `[laughs]`, `<whisper>`) count as a word each: they cost a little time."""
    cjk = sum(is_cjk(character) for character in text)
    words = len("".join(" " if is_cjk(character) else character for character in text).split())
    return max(MIN_EXPECTED_SECONDS, cjk / CJK_CHARACTERS_PER_SECOND + words / WORDS_PER_SECOND)


MIN_SPEECH_FRACTION = 0.2
"""Audio shorter than this fraction of its transcript's expected duration cannot hold that
transcript (it would be five times the assumed speaking rate): it is cut, or the wrong transcript."""


def speech_shortfall(seconds: float, text: str, fraction: float = MIN_SPEECH_FRACTION) -> str | None:
    """Why `seconds` of audio cannot be a recording of `text` (shorter than `fraction` of its
    expected duration), or None."""
    expected = expected_seconds_of_text(text)
    if seconds >= fraction * expected:
        return None
    return f"{seconds:.3f} s of audio for a transcript of about {expected:.1f} s (at least {fraction * expected:.2f} s expected)"


def target_text_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, eos_token_id: int, is_semantic) -> torch.Tensor:
    """Text tokens of the turn to speak, per prompt `[batch]`.

    In the published layout the prompt ends `... <|im_end|>\\n <|im_start|>user\\n lines <|im_end|>\\n
    <|im_start|>assistant\\n<|voice|>`: the turn to speak lies between the last two `<|im_end|>`.
    A prompt with fewer than two counts all its text rows. The few layout tokens of the turn are
    counted too (a slight overestimate)."""
    real = attention_mask.bool() & ~is_semantic(input_ids)
    ends = (input_ids == eos_token_id) & attention_mask.bool()
    counts = []
    for item in range(input_ids.shape[0]):
        positions = ends[item].nonzero().flatten().tolist()
        if len(positions) >= 2:
            start, stop = positions[-2] + 1, positions[-1]
            counts.append(int(real[item, start:stop].sum()))
        else:
            counts.append(int(real[item].sum()))
    return torch.tensor(counts, dtype=torch.long)


def speak_span_tokens(speak_span: torch.Tensor) -> torch.Tensor:
    """Text tokens of the turn to speak, per prompt `[batch]`, from the layout's `speak_span`
    `[batch, 2]` (the processor's rows say where that turn's text is; nothing is searched)."""
    return (speak_span[:, 1] - speak_span[:, 0]).clamp(min=0).cpu()


def expected_seconds_of_tokens(tokens: torch.Tensor, tokens_per_second: float = TOKENS_PER_SECOND) -> torch.Tensor:
    """Expected speech duration of `tokens` text tokens at `tokens_per_second` (default
    `TOKENS_PER_SECOND`, Qwen's tokenizer; see `text_tokens_per_second`), at least 1 s."""
    return (tokens.float() / tokens_per_second).clamp(min=MIN_EXPECTED_SECONDS)


def _config_number(model, name: str, above: float, expected: str) -> float | None:
    """The generation config's number `name` (None when it has none), refused unless finite and above `above`."""
    value = getattr(getattr(model, "generation_config", None), name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= above:
        raise ValueError(f"generation_config.{name}={value!r}; expected {expected}")
    return float(value)


def overlong_factor(model) -> float | None:
    """The generation config's `overlong_factor`: a take that ends by itself after more than this
    many times its expected duration is anomalous ("overlong"). None (the default) checks nothing:
    the published model's expected duration is a rough words-a-second guess, and directed speech
    with its pauses may well last twice that. A model whose speaking rate is measured may set it
    to catch takes that loop back over their text and then stop (drama3-tiny's takes of one text
    vary little in length, but its loops come back on retries, so it does not set it:
    recipes/drama3_tiny/README.md)."""
    return _config_number(model, "overlong_factor", 1, "a number above 1 (or None: off)")


def text_tokens_per_second(model) -> float:
    """The speaking rate, in text tokens per second, that sets this model's frame budgets: the
    generation config's `text_tokens_per_second` when it has one (a model whose tokenizer spends
    more tokens a word, such as a phoneme front end, records its own), else `TOKENS_PER_SECOND`."""
    rate = _config_number(model, "text_tokens_per_second", 0, "a positive number of tokens a second")
    return TOKENS_PER_SECOND if rate is None else rate


def frame_budgets(
    expected_seconds: torch.Tensor,
    frame_rate: float,
    max_new_tokens: int | None = None,
    budget_factor: float = BUDGET_FACTOR,
    max_frames: int = MAX_FRAMES,
) -> torch.Tensor:
    """Frames each take may use: `budget_factor` (2.5) x its expected duration, never above
    `max_frames` (4096) nor `max_new_tokens`, at least 1. expected_seconds: [batch] -> [batch]."""
    budgets = (expected_seconds.double() * budget_factor * frame_rate).ceil().long().clamp(max=max_frames)
    if max_new_tokens is not None:
        budgets = budgets.clamp(max=int(max_new_tokens))
    return budgets.clamp(min=1)


def longest_silence_seconds(waveform: torch.Tensor, sampling_rate: int) -> float:
    """Longest run of silent 100 ms windows in a waveform `[samples]`, in seconds."""
    window = max(1, int(SILENCE_WINDOW_SECONDS * sampling_rate))
    windows = waveform.float().flatten()
    usable = windows.shape[0] // window * window
    if usable == 0:
        return waveform.numel() / sampling_rate if float(waveform.float().pow(2).mean().sqrt().nan_to_num()) < SILENCE_RMS else 0.0
    rms = windows[:usable].view(-1, window).pow(2).mean(dim=-1).sqrt()
    longest = run = 0
    for silent in (rms < SILENCE_RMS).tolist():
        run = run + 1 if silent else 0
        longest = max(longest, run)
    return longest * window / sampling_rate


def detect_anomalies(
    length: int,
    finish_reason: str,
    expected_frames: float,
    budget: int,
    waveform: torch.Tensor | None = None,
    sampling_rate: int | None = None,
    overlong: float | None = None,
) -> list[str]:
    """What is wrong with one take (paper §9): a subset of `ANOMALIES`, empty when it looks fine.

    - runaway: it used its whole budget (2.5x the expected duration, or 4096 frames) without eos;
    - too_short: it ended before 25% of its expected duration (or produced nothing);
    - silent: its waveform is below -50 dBFS throughout (needs the waveform);
    - long_silence: its waveform holds more than 3 s of silence (needs the waveform);
    - overlong: it ended by itself after more than `overlong` times its expected duration (only
      with `overlong`, see `overlong_factor`).
    """
    found = []
    if finish_reason == "length" and length >= budget:
        found.append("runaway")
    if finish_reason == "eos" and (length == 0 or length < TOO_SHORT_FRACTION * expected_frames):
        found.append("too_short")
    if finish_reason == "eos" and overlong is not None and length > overlong * expected_frames:
        found.append("overlong")
    if waveform is not None and waveform.numel():
        rms = float(waveform.float().pow(2).mean().sqrt())
        if rms < SILENCE_RMS:
            found.append("silent")
        elif longest_silence_seconds(waveform, sampling_rate) > LONG_SILENCE_SECONDS:
            found.append("long_silence")
    return found


# ----------------------------------------------------------------------------- the decode loop


@dataclass
class Drama3Cache:
    """Decode state: the backbone's hybrid cache (conv + recurrent states for Gated DeltaNet layers,
    keys/values for attention layers) and one key/value cache per tower layer."""

    backbone: DynamicCache
    tower: DynamicCache

    @classmethod
    def empty(cls, config: Drama3Config) -> Drama3Cache:
        return cls(backbone=DynamicCache(config=config.text_config), tower=DynamicCache())

    def get_seq_length(self) -> int:
        return self.backbone.get_seq_length()


@dataclass
class FrameStep:
    """What one decode step produced for the batch.

    main_ids: [batch] the drawn main token (a `<|semantic:c0|>`, eos, or `<|audio_separator|>`);
    frames: [batch, num_codebooks] (zeros where no frame was made);
    produced: [batch] the item was still speaking and this is one of its frames;
    ended: [batch] the item ended at this step (eos, or its budget is used up);
    eos: [batch] the item ended with eos;
    boundary: [batch] the item drew `<|audio_separator|>`: its current line ended and the next
    begins (no frame).
    """

    step: int
    main_ids: torch.Tensor
    frames: torch.Tensor
    produced: torch.Tensor
    ended: torch.Tensor
    eos: torch.Tensor
    boundary: torch.Tensor | None = None


@dataclass
class LineSeparators:
    """Where the backbone may draw `<|audio_separator|>` (line-by-line layouts).

    token_id: the id of `<|audio_separator|>`; left: [batch] how many more separators each item
    may draw (the line boundaries its prompt has not spoken yet; 0: the token stays masked).
    """

    token_id: int
    left: torch.Tensor


def separators_left(input_ids: torch.Tensor, attention_mask: torch.Tensor, eos_token_id: int, separator_id: int) -> torch.Tensor:
    """Line boundaries each prompt still has to speak, `[batch]`.

    A line-by-line prompt separates its k lines with k - 1 separators in the last user turn (between
    its last two `<|im_end|>`); its voice turn (after the last `<|im_end|>`) already holds one
    separator per line it continues from. Other layouts give 0: the published one has no
    separator, infilling has one only in the voice turn."""
    real = attention_mask.bool()
    separators = (input_ids == separator_id) & real
    ends = (input_ids == eos_token_id) & real
    counts = []
    for item in range(input_ids.shape[0]):
        positions = ends[item].nonzero().flatten().tolist()
        if len(positions) < 2:
            counts.append(0)
            continue
        between = int(separators[item, positions[-2] + 1 : positions[-1]].sum())
        after = int(separators[item, positions[-1] + 1 :].sum())
        counts.append(max(0, between - after))
    return torch.tensor(counts, dtype=torch.long, device=input_ids.device)


def main_logits(model, hidden: torch.Tensor, separators: LineSeparators | None) -> torch.Tensor:
    """Restricted main logits `[batch, 1, codebook_size + 1 (+ 1)]`: the band and eos, then the
    separator (-inf for items that may not draw it) when `separators` is given."""
    token_id, left = (None, None) if separators is None else (separators.token_id, separators.left)
    return restricted_main_logits(model, hidden, token_id, left)


@dataclass
class DecodeState:
    """Where a decode run stands between steps.

    cache: its `Drama3Cache`; hidden [batch, 1, dim]: the backbone output of the open row (the
    last row fed, whose next row is not drawn yet); ids [batch, 1] / codes [batch, 1,
    num_codebooks]: that row; mask [batch, rows fed]."""

    cache: Drama3Cache
    hidden: torch.Tensor
    ids: torch.Tensor
    codes: torch.Tensor
    mask: torch.Tensor


def prefilled(model, input_ids: torch.Tensor, audio_codes: torch.Tensor, attention_mask: torch.Tensor) -> DecodeState:
    """A fresh cache filled with a prompt (input_ids [batch, rows], ...); its last row is open."""
    cache = Drama3Cache.empty(model.config)
    hidden = model.prefill(input_ids, audio_codes, attention_mask, cache)[:, -1:]
    return DecodeState(cache, hidden, input_ids[:, -1:], audio_codes[:, -1:], attention_mask)


def decode_steps(
    model,
    input_ids: torch.Tensor,
    audio_codes: torch.Tensor,
    attention_mask: torch.Tensor,
    sampler: Drama3Sampler,
    budgets: torch.Tensor,
    separators: LineSeparators | None = None,
    aligner: AlignmentTracker | None = None,
) -> Iterator[FrameStep]:
    """Prefill once, then one step per main token until every item has ended (`decode_from`).

    input_ids [batch, rows], audio_codes [batch, rows, num_codebooks], attention_mask [batch, rows]
    (left padding); budgets [batch] frames each item may produce."""
    state = prefilled(model, input_ids, audio_codes, attention_mask)
    yield from decode_from(model, state, sampler, budgets, separators, aligner)


def decode_from(
    model,
    state: DecodeState,
    sampler: Drama3Sampler,
    budgets: torch.Tensor,
    separators: LineSeparators | None = None,
    aligner: AlignmentTracker | None = None,
) -> Iterator[FrameStep]:
    """One step per main token from `state` until every item has ended; `state` follows along (after
    the run its open row is the last row fed: the last frame before eos, or, for an item that used
    its budget, the frame before its last one, whose last frame was never fed).

    budgets [batch] frames each item may produce. With `separators` (and a sampler whose candidates
    end with the separator), an item may draw `<|audio_separator|>` while it has line boundaries
    left: that step makes no frame and draws no code, and the separator goes back in as a text row
    with zero codes, as in the training rows. Items that ended keep stepping with the batch (their
    outputs are ignored): every item's computation is independent of the others', so a batch
    produces what each prompt produces alone.

    With `aligner` (`phoneme_alignment`), the main token and the phoneme codebooks are drawn among
    the codes the aligner allows, and every drawn phoneme code moves it along the text.
    """
    config = model.config
    batch = state.ids.shape[0]
    device = state.ids.device
    produced_count = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    budgets = budgets.to(device)
    if separators is not None:
        separators = LineSeparators(separators.token_id, separators.left.to(device).clone())
    step = 0
    while True:
        logits = main_logits(model, state.hidden, separators)
        if aligner is not None:
            logits = aligner.main_logits(logits)
        main_ids = sampler.main_token(logits, active=active)  # [batch, 1]
        eos = main_ids[:, 0] == config.eos_token_id
        boundary = torch.zeros_like(eos) if separators is None else active & (main_ids[:, 0] == separators.token_id)
        speaking = active & ~eos & ~boundary
        if (speaking | boundary).any():
            semantic = (main_ids - config.semantic_start_token_id).clamp(0, config.codebook_size - 1)
            if aligner is not None:
                aligner.observe(semantic[:, 0], speaking)

            def sample(logits, codebook_index, drawing=speaking):
                return draw_within(
                    aligner, lambda head: sampler.codebook(head, codebook_index, drawing), logits, codebook_index, drawing
                )

            frames = model.tower_step(
                state.hidden, state.ids, state.codes, semantic, state.mask, state.cache, sample, ~boundary
            )
            frames = frames.masked_fill(boundary[:, None, None], 0)
        else:
            frames = state.codes.new_zeros(batch, 1, config.num_codebooks)
        if separators is not None:
            separators.left -= boundary.long()
        produced_count += speaking.long()
        ended = active & (eos | (produced_count >= budgets))
        active = active & ~ended
        yield FrameStep(step, main_ids[:, 0], frames[:, 0], speaking, ended, eos & ended, boundary)
        if not active.any():
            return
        state.mask = torch.cat((state.mask, state.mask.new_ones(batch, 1)), dim=1)
        state.hidden = model.decode_row(main_ids, frames, state.mask, state.cache)
        state.ids, state.codes = main_ids, frames
        step += 1


def static_decode_steps(
    model,
    input_ids: torch.Tensor,
    audio_codes: torch.Tensor,
    attention_mask: torch.Tensor,
    sampler: Drama3Sampler,
    budgets: torch.Tensor,
    separators: LineSeparators | None = None,
    compile_config=None,
) -> Iterator[FrameStep]:
    """`decode_steps` on the static path: the same prefill, then one `static_step` per main token
    on preallocated caches (compiled with `compile_config`; None: eager), until every item has
    ended. Yields the FrameSteps `decode_steps` yields for the same request: the same frames
    (greedy: bitwise equal codes; sampled: the same draws, from the same generators)."""
    state = prefilled(model, input_ids, audio_codes, attention_mask)
    budgets = budgets.to(input_ids.device)
    left = None if separators is None else separators.left
    # every item takes at most one step per frame and one per line boundary, plus the last row fed
    most_steps = int((budgets + (0 if left is None else left.to(budgets.device).clamp(min=0))).max())
    max_length = static_length(input_ids.shape[1] + most_steps + 1)
    cache = Drama3StaticCache.from_filled(state.cache, max_length)
    static = StaticDecodeState.opened(state.hidden, state.ids, state.codes, attention_mask, max_length, budgets, left)
    step_function = compiled_step(compile_config)
    separator_id = None if separators is None else separators.token_id
    candidates, batch = sampler.candidate_ids.shape[0], input_ids.shape[0]
    step = 0
    while True:
        noise = sampler.step_noise(batch, candidates, model.config.num_codebooks, input_ids.device)
        output, static = step_function(model, cache, sampler, static, noise, separator_id)
        sampler.rewind(noise, output.speaking, output.boundary)
        yield FrameStep(step, output.main_ids, output.frames, output.speaking, output.ended, output.eos, output.boundary)
        if not bool(static.active.any()):
            return
        step += 1


class TakeCollector:
    """Gathers the frames and line boundaries of every item; `finish()` drops click frames."""

    def __init__(self, batch: int):
        self.frames: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.finish_reasons = [""] * batch
        self.line_boundaries: list[list[int]] = [[] for _ in range(batch)]
        self.last_was_frame = [False] * batch

    @property
    def lengths(self) -> list[int]:
        return [len(frames) for frames in self.frames]

    def add(self, step: FrameStep) -> None:
        for item in step.produced.nonzero().flatten().tolist():
            self.frames[item].append(step.frames[item])
            self.last_was_frame[item] = True
        if step.boundary is not None:
            for item in step.boundary.nonzero().flatten().tolist():
                self.line_boundaries[item].append(len(self.frames[item]))
                self.last_was_frame[item] = False
        for item in step.ended.nonzero().flatten().tolist():
            self.finish_reasons[item] = "eos" if bool(step.eos[item]) else "length"

    def takes(self, num_codebooks: int) -> list[torch.Tensor]:
        """Every item's frames as drawn, click frames included: per item [frames, num_codebooks]."""
        return [
            torch.stack(frames) if frames else torch.zeros(0, num_codebooks, dtype=torch.long)
            for frames in self.frames
        ]

    def finish(self, num_codebooks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """codes [batch, frames, num_codebooks] (0 after each item's length), lengths [batch], and
        which items lost a `<|semantic:0|>` frame right before eos (not before a line boundary)."""
        clicks = [
            reason == "eos" and last and bool(frames) and int(frames[-1][0]) == 0
            for reason, last, frames in zip(self.finish_reasons, self.last_was_frame, self.frames)
        ]
        kept = [frames[:-1] if click else frames for frames, click in zip(self.frames, clicks)]
        lengths = torch.tensor([len(frames) for frames in kept], dtype=torch.long, device=device)
        codes = torch.zeros(len(kept), max(lengths.tolist(), default=0), num_codebooks, dtype=torch.long, device=device)
        for item, frames in enumerate(kept):
            if frames:
                codes[item, : len(frames)] = torch.stack(frames).to(device)
        return codes, lengths, clicks


class ClickFilter:
    """Streaming counterpart of the click rule, for one item: a `<|semantic:0|>` frame is held back
    one step and dropped if eos follows it; a line boundary releases it."""

    def __init__(self):
        self.held: torch.Tensor | None = None

    def release(self, step: FrameStep, item: int = 0) -> list[torch.Tensor]:
        """Frames [num_codebooks] that are now final."""
        if step.boundary is not None and bool(step.boundary[item]):
            released = [] if self.held is None else [self.held]
            self.held = None
            return released
        if not bool(step.produced[item]):
            self.held = None  # eos (or already ended): a held frame was a click
            return []
        released = [] if self.held is None else [self.held]
        self.held = None
        frame = step.frames[item]
        if int(frame[0]) == 0 and not bool(step.ended[item]):
            self.held = frame
        else:
            released.append(frame)
        return released


# ----------------------------------------------------------------------------- waveform streaming


def default_stream_windows() -> Iterator[int]:
    """Frames per streamed waveform chunk: 10, 10, 12, 32, then 64 for ever (the codec's serving
    schedule, `codec.streaming.stream_decode_windows`)."""
    return stream_decode_windows()


@dataclass
class AudioChunk:
    """A piece of a streamed take.

    audio: [samples] waveform at `sampling_rate`; codes: [frames, num_codebooks] the frames it
    decodes; first_frame: index of its first frame in the take; elapsed: seconds since the
    request started when the chunk was ready (the first chunk's is the time to first audio);
    line_boundaries: line boundaries (frame indices in the take, as `Drama3GenerationOutput.
    line_boundaries`) reported with this chunk: each with the first chunk that ends at or after it
    once the separator is drawn, so all of them up to the end of this chunk are known.
    """

    audio: torch.Tensor | None
    codes: torch.Tensor
    first_frame: int
    elapsed: float
    sampling_rate: int
    is_last: bool = False
    line_boundaries: list[int] = field(default_factory=list)


class WaveformStreamer:
    """Turns final frames into waveform chunks with the codec's streaming decoder, one window at
    a time. The decoder is causal and keeps its state between windows, so the chunks concatenate
    to the offline decode of the same frames."""

    def __init__(self, codec, started: float, windows: Iterator[int] | None = None):
        self.codec = codec
        self.decoder = codec.streaming_decoder(batch_size=1) if codec is not None else None
        self.windows = windows if windows is not None else (default_stream_windows() if codec is not None else None)
        self.window = next(self.windows) if self.windows is not None else 1
        self.pending: list[torch.Tensor] = []
        self.emitted_frames = 0
        self.started = started
        self.time_to_first_audio: float | None = None
        self.sampling_rate = codec.sampling_rate if codec is not None else None
        self.unreported_boundaries: list[int] = []

    def mark_boundary(self) -> None:
        """A line ends after the frames pushed so far."""
        self.unreported_boundaries.append(self.emitted_frames + len(self.pending))

    def step(self, clicks: ClickFilter, step: FrameStep) -> list[AudioChunk]:
        """Push what one decode step made final (item 0) and note its line boundary."""
        chunks = self.push(clicks.release(step))
        if step.boundary is not None and bool(step.boundary[0]):
            self.mark_boundary()
        return chunks

    def push(self, frames: list[torch.Tensor]) -> list[AudioChunk]:
        self.pending.extend(frames)
        chunks = []
        while len(self.pending) >= self.window:
            chunks.append(self._emit(self.window, is_last=False))
            self.window = next(self.windows) if self.windows is not None else 1
        return chunks

    def end_window(self) -> list[AudioChunk]:
        """Emit the frames pushed so far as a short window and start the window schedule again
        (10, 10, 12, ...): a turn of streaming text input ended, and its audio must not wait for
        frames of a turn whose text may not have arrived yet."""
        chunks = [self._emit(len(self.pending), is_last=False)] if self.pending else []
        self.windows = default_stream_windows() if self.codec is not None else None
        self.window = next(self.windows) if self.windows is not None else 1
        return chunks

    def finish(self) -> list[AudioChunk]:
        chunk = self._emit(len(self.pending), is_last=True)
        if self.decoder is not None and hasattr(self.decoder, "flush"):
            tail = self.decoder.flush()
            if tail is not None and chunk.audio is not None and tail.numel():
                chunk.audio = torch.cat((chunk.audio, tail.reshape(-1).to(chunk.audio)))
        return [chunk]

    def _emit(self, frames: int, is_last: bool) -> AudioChunk:
        taken, self.pending = self.pending[:frames], self.pending[frames:]
        codes = torch.stack(taken) if taken else torch.zeros(0, 0, dtype=torch.long)
        audio = None
        if self.decoder is not None:
            if taken:
                audio = self.decoder.push(codes.T[None].to(self.codec.device))[0].reshape(-1)
            else:
                audio = torch.zeros(0, device=self.codec.device)
        elapsed = time.perf_counter() - self.started
        if self.time_to_first_audio is None and taken:
            self.time_to_first_audio = elapsed
        chunk = AudioChunk(audio, codes, self.emitted_frames, elapsed, self.sampling_rate, is_last)
        self.emitted_frames += len(taken)
        chunk.line_boundaries = [b for b in self.unreported_boundaries if b <= self.emitted_frames or is_last]
        self.unreported_boundaries = self.unreported_boundaries[len(chunk.line_boundaries) :]
        return chunk


# ----------------------------------------------------------------------------- generate()


@dataclass
class Drama3GenerationOutput(ModelOutput):
    """What `generate(..., return_dict_in_generate=True)` returns.

    Args:
        audio_codes: [batch, frames, num_codebooks] the takes, 0 after each item's length.
        sequences: the same tensor under the name `GenerationMixin` users (and the text-to-audio
            pipeline, which decodes it with the processor) read.
        lengths: [batch] frames of each take.
        audio: per item a waveform [samples] (when a codec was given).
        finish_reasons: per item "eos" or "length" (budget or max_new_tokens used up).
        budgets: [batch] frames each take was allowed.
        expected_frames: [batch] the expected duration of each take, in frames.
        anomalies: per item the guard findings (see `detect_anomalies`).
        regenerations: one record per regenerated item and attempt: {"item", "attempt",
            "anomalies" (before), "new_anomalies", "kept"}.
        ras_replacements: [batch] main tokens RAS replaced.
        clicks_dropped: per item whether a `<|semantic:0|>` frame before eos was dropped.
        time_to_first_audio: seconds from the call to the first streamed chunk (with a streamer).
        line_boundaries: per item, the frame index where each new line starts (one per
            `<|audio_separator|>` drawn, line-by-line prompts only): item b's line k is
            `audio_codes[b, bounds[k - 1]:bounds[k]]` with bounds = [0, *line_boundaries[b],
            lengths[b]] (see `split_lines`).
    """

    audio_codes: torch.LongTensor | None = None
    sequences: torch.LongTensor | None = None
    lengths: torch.LongTensor | None = None
    audio: list[torch.Tensor] | None = None
    finish_reasons: list[str] | None = None
    budgets: torch.LongTensor | None = None
    expected_frames: torch.Tensor | None = None
    anomalies: list[list[str]] | None = None
    regenerations: list[dict] | None = None
    ras_replacements: torch.LongTensor | None = None
    clicks_dropped: list[bool] | None = None
    time_to_first_audio: float | None = None
    line_boundaries: list[list[int]] | None = None


def split_lines(take: torch.Tensor, line_boundaries: Sequence[int]) -> list[torch.Tensor]:
    """One take's frames [frames, ...] -> one piece per line, cut at its line boundaries."""
    bounds = [0, *line_boundaries, take.shape[0]]
    return [take[start:end] for start, end in zip(bounds[:-1], bounds[1:])]


_OWN_ARGUMENTS = (
    "seed", "preset", "codec", "expected_seconds", "regenerate_on_anomaly", "audio_separator_token_id", "threads",
)


def prepare_prompt(model, input_ids, audio_codes, attention_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check and shape a prompt: input_ids [batch, rows] (or [rows]), audio_codes [batch, rows,
    num_codebooks] (zeros when None), attention_mask [batch, rows] (ones when None, left padding only)."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids: the prompt rows (processor output or [batch, rows] ids)")
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        audio_codes = None if audio_codes is None else torch.as_tensor(audio_codes)[None]
        attention_mask = None if attention_mask is None else torch.as_tensor(attention_mask)[None]
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}; expected integer [batch, rows]")
    batch, rows = input_ids.shape
    if rows < 2:
        raise ValueError(f"input_ids has {rows} row(s); a prompt needs at least 2")
    _check_range(input_ids, "input_ids", model.config.text_config.vocab_size, "the text vocabulary")
    codebooks = model.config.num_codebooks
    if audio_codes is None:
        audio_codes = input_ids.new_zeros(batch, rows, codebooks)
    audio_codes = torch.as_tensor(audio_codes)
    if tuple(audio_codes.shape) != (batch, rows, codebooks):
        raise ValueError(
            f"audio_codes has shape {tuple(audio_codes.shape)}; expected [batch, rows, num_codebooks] = "
            f"{(batch, rows, codebooks)} to match input_ids"
        )
    _check_range(audio_codes, "audio_codes", model.config.codebook_size, "the codebook size")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask)
    if tuple(attention_mask.shape) != (batch, rows):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, rows)}")
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError("attention_mask: the last row of every prompt must be real; pad prompts on the left")
    real_rows = attention_mask.bool().sum(dim=1)
    if bool((real_rows < 2).any()):
        item = int((real_rows < 2).nonzero()[0])
        raise ValueError(f"attention_mask: prompt {item} has {int(real_rows[item])} real row(s); a prompt needs at least 2")
    device = model.device
    return input_ids.long().to(device), audio_codes.long().to(device), attention_mask.long().to(device)


def _check_range(values: torch.Tensor, name: str, size: int, what: str) -> None:
    """Ids index embedding tables: refuse what would be clamped or raise a bare IndexError."""
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {values.dtype}; expected integer ids")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= size):
        raise ValueError(
            f"{name} holds values in [{int(values.min())}, {int(values.max())}]; expected [0, {size}) ({what})"
        )


def _split_kwargs(kwargs: dict) -> dict:
    """Generation parameters among `kwargs`; any other name is an error (it would be ignored)."""
    known = {key for key in vars(GenerationConfig()) if not key.startswith("_")} | {"repetition_aware", ALIGNMENT_KEY}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"generate() got unknown arguments {unknown}; it takes the prompt (input_ids, audio_codes, "
            f"attention_mask), GenerationConfig fields and {list(_OWN_ARGUMENTS)}"
        )
    return kwargs


@dataclass
class _Request:
    """Everything one run of the decode loop needs, resolved once per call."""

    settings: SamplingSettings
    budgets: torch.Tensor
    guard_budgets: torch.Tensor
    expected_frames: torch.Tensor
    separators: LineSeparators | None = None
    decoding: DecodeOptions = field(default_factory=lambda: DecodeOptions())
    alignment: AlignmentTracker | None = None

    def select(self, index: torch.Tensor) -> _Request:
        """The request of the items `index` (a long tensor)."""
        separators = self.separators
        if separators is not None:
            separators = LineSeparators(separators.token_id, separators.left[index.to(separators.left.device)])
        index = index.cpu()
        alignment = None if self.alignment is None else self.alignment.select(index.tolist())
        return _Request(
            self.settings, self.budgets[index], self.guard_budgets[index], self.expected_frames[index], separators,
            self.decoding, alignment,
        )


@dataclass(frozen=True)
class DecodeOptions:
    """How the decode loop runs: `static` (`cache_implementation="static"`) steps on preallocated
    caches (`static_decoding`), compiled with `compile_config` (None: eager)."""

    static: bool = False
    compile_config: CompileConfig | None = None


def resolve_decoding(model, generation_config: GenerationConfig | None, overrides: dict) -> DecodeOptions:
    """The decode options of a call, read as transformers reads them: `cache_implementation`
    ("static" or "dynamic"), `compile_config` and `disable_compile`, from the model's generation
    config, then the call's, then keyword arguments. A static cache is compiled when a
    `compile_config` is given, or by default on CUDA (`default_compile_config`: one graph per step
    with CUDA graphs), unless `disable_compile`."""
    values: dict = {}
    for source in (getattr(model, "generation_config", None), generation_config, overrides):
        if source is None:
            continue
        for name in ("cache_implementation", "compile_config", "disable_compile"):
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if value is not None:
                values[name] = value
    implementation = values.get("cache_implementation")
    check_cache_implementation(implementation)
    if implementation != "static":
        return DecodeOptions()
    compile_config = values.get("compile_config")
    if compile_config is not None and not isinstance(compile_config, CompileConfig):
        raise ValueError(f"compile_config={compile_config!r}; expected a transformers CompileConfig")
    if values.get("disable_compile"):
        return DecodeOptions(static=True)
    if compile_config is None and model.device.type == "cuda":
        compile_config = default_compile_config()
    return DecodeOptions(static=True, compile_config=compile_config)


def resolve_separator_id(model, generation_config: GenerationConfig | None, explicit: int | None) -> int | None:
    """The id of `<|audio_separator|>`: the argument, else `audio_separator_token_id` of the call's
    generation config, of the model's generation config, or of the model's config; else None."""
    if explicit is not None:
        return int(explicit)
    for source in (generation_config, getattr(model, "generation_config", None), model.config):
        value = getattr(source, "audio_separator_token_id", None)
        if value is not None:
            return int(value)
    return None


def line_separators(
    model, input_ids, attention_mask, separator_id: int | None, boundaries_left: torch.Tensor | None = None
) -> LineSeparators | None:
    """The separator rule of a batch: None unless some prompt is a line-by-line prompt.

    `boundaries_left` [batch] is what the processor's layout says; rows given without it are read
    by `separators_left`."""
    if separator_id is None:
        return None
    vocabulary = model.get_output_embeddings().weight.shape[0]
    config = model.config
    if not 0 <= separator_id < vocabulary or separator_id == config.eos_token_id or bool(model.is_semantic(torch.tensor(separator_id))):
        raise ValueError(
            f"audio_separator_token_id={separator_id} is not a text token of this model (vocabulary "
            f"{vocabulary}, eos {config.eos_token_id}, semantic band {config.semantic_start_token_id}.."
            f"{config.semantic_end_token_id})"
        )
    if boundaries_left is not None:
        left = torch.as_tensor(boundaries_left, dtype=torch.long).flatten().to(input_ids.device)
    else:
        left = separators_left(input_ids, attention_mask, config.eos_token_id, separator_id)
    return LineSeparators(separator_id, left) if bool(left.any()) else None


def make_sampler(model, request: _Request, input_ids, attention_mask, seed) -> Drama3Sampler:
    """The sampler of one run; with line separators the separator is the last candidate, and only
    the items that may draw it draw a random number for it."""
    device = input_ids.device
    candidates = model.speech_token_ids(device)
    codebook_size = candidates.shape[0] - 1
    widths = None
    if request.separators is not None:
        candidates = torch.cat((candidates, torch.tensor([request.separators.token_id], device=device)))
        widths = codebook_size + 1 + (request.separators.left > 0).long()
    return Drama3Sampler(
        request.settings, candidates, prompt_window(input_ids, attention_mask),
        item_generators(seed, input_ids.shape[0], device), codebook_size, widths,
    )


def _resolve_request(
    model, settings, input_ids, attention_mask, max_new_tokens, expected_seconds, separator_id=None, layout=None
) -> _Request:
    """`layout`: the processor's `speak_span` / `boundaries_left` when the rows came with them."""
    config = model.config
    layout = layout or {}
    overlong_factor(model)  # a bad value is refused before any work, not after the takes
    if expected_seconds is None and layout.get("speak_span") is not None:
        seconds = expected_seconds_of_tokens(
            speak_span_tokens(torch.as_tensor(layout["speak_span"])), text_tokens_per_second(model)
        )
    elif expected_seconds is None:
        tokens = target_text_tokens(input_ids.cpu(), attention_mask.cpu(), config.eos_token_id, model.is_semantic)
        seconds = expected_seconds_of_tokens(tokens, text_tokens_per_second(model))
    else:
        seconds = torch.as_tensor(expected_seconds, dtype=torch.float32).flatten().cpu()
        if seconds.numel() == 1:
            seconds = seconds.expand(input_ids.shape[0])
        if seconds.numel() != input_ids.shape[0] or not bool((seconds > 0).all() and seconds.isfinite().all()):
            raise ValueError(f"expected_seconds={expected_seconds!r}; expected one positive value or one per item")
    frame_rate = config.frame_rate
    return _Request(
        settings=settings,
        budgets=frame_budgets(seconds, frame_rate, max_new_tokens),
        guard_budgets=frame_budgets(seconds, frame_rate),
        expected_frames=seconds * frame_rate,
        separators=line_separators(model, input_ids, attention_mask, separator_id, layout.get("boundaries_left")),
    )


@dataclass
class _Call:
    """One generate() or stream() call, checked and resolved: the prompt (input_ids, audio_codes,
    attention_mask), its request, and whether the caller asked for a `Drama3GenerationOutput`."""

    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    request: _Request
    return_dict: bool


def _set_up(
    model, input_ids, audio_codes, attention_mask, generation_config, preset, expected_seconds,
    audio_separator_token_id, layout: dict, kwargs: dict, streaming: str | None,
) -> _Call:
    """Read the arguments of a call in one place: the sampling settings, the prompt, its frame
    budgets and line separators (`layout`: the processor's `speak_span` / `boundaries_left`).
    `streaming` names what streams ("streamer", "stream()"), or None: streaming needs a batch of
    1 prompt."""
    overrides = _split_kwargs(kwargs)
    settings, max_new_tokens, return_dict = resolve_settings(
        getattr(model, "generation_config", None), preset, generation_config, overrides
    )
    prompt = prepare_prompt(model, input_ids, audio_codes, attention_mask)
    if streaming is not None and prompt[0].shape[0] != 1:
        raise ValueError(f"{streaming}: streaming needs a batch of 1 prompt; got {prompt[0].shape[0]}")
    separator_id = resolve_separator_id(model, generation_config, audio_separator_token_id)
    request = _resolve_request(
        model, settings, prompt[0], prompt[2], max_new_tokens, expected_seconds, separator_id, layout
    )
    request = replace(request, decoding=resolve_decoding(model, generation_config, overrides))
    alignment = resolve_alignment(model, [generation_config, overrides])
    if alignment is not None:
        if request.decoding.static:
            raise ValueError(
                f"{ALIGNMENT_KEY} runs on the dynamic cache: pass {ALIGNMENT_KEY}=False with cache_implementation='static'"
            )
        rows = turn_token_ids(prompt[0].cpu(), prompt[2].cpu(), model.config.eos_token_id, layout.get("speak_span"))
        tracker = AlignmentTracker(alignment, rows, model.config.codebook_size, request.expected_frames.tolist())
        request = replace(request, alignment=tracker)
    return _Call(prompt, request, return_dict)


def check_codec_matches(config, codec, location: str = "codec") -> None:
    """The codec's frames are the ones the model counts: its frame rate must be the config's
    (`sampling_rate / frame_size`), else budgets, durations and streaming windows are off."""
    if codec is None:
        return
    if not math.isclose(float(codec.frame_rate), float(config.frame_rate), rel_tol=1e-6):
        raise ValueError(
            f"{location}: {float(codec.frame_rate):.4f} frames/s, but the model's config says {float(config.frame_rate):.4f} "
            f"(sampling_rate {config.sampling_rate} / frame_size {config.frame_size}); use the codec the model was trained with"
        )


def _start(model, input_ids, audio_codes, attention_mask, request: _Request, seed) -> tuple[Drama3Sampler, Iterator[FrameStep]]:
    """The sampler of one decode run and its steps (not started until iterated)."""
    sampler = make_sampler(model, request, input_ids, attention_mask, seed)
    if request.decoding.static:
        steps = static_decode_steps(
            model, input_ids, audio_codes, attention_mask, sampler, request.budgets, request.separators,
            request.decoding.compile_config,
        )
    else:
        # a fresh tracker per run: every run starts at the beginning of its text
        aligner = None if request.alignment is None else request.alignment.select(range(input_ids.shape[0]))
        steps = decode_steps(
            model, input_ids, audio_codes, attention_mask, sampler, request.budgets, request.separators, aligner
        )
    return sampler, steps


def _run(model, input_ids, audio_codes, attention_mask, request: _Request, seed, codec, streamer=None):
    """One decode run over a batch: the takes, their waveforms and what the guards found."""
    started = time.perf_counter()
    sampler, steps = _start(model, input_ids, audio_codes, attention_mask, request, seed)
    collector = TakeCollector(input_ids.shape[0])
    waveform_streamer = clicks = None
    if streamer is not None:
        waveform_streamer, clicks = WaveformStreamer(codec, started), ClickFilter()
    for step in steps:
        collector.add(step)
        if waveform_streamer is not None:
            for chunk in waveform_streamer.step(clicks, step):
                put_chunk(streamer, chunk)
    if waveform_streamer is not None:
        for chunk in waveform_streamer.finish():
            if chunk.codes.numel():
                put_chunk(streamer, chunk)
        streamer.end()
    codes, lengths, clicks_dropped = collector.finish(model.config.num_codebooks, input_ids.device)
    audio = decode_audio(codec, codes, lengths) if codec is not None else None
    overlong = overlong_factor(model)
    anomalies = [
        detect_anomalies(
            int(lengths[item]),
            collector.finish_reasons[item],
            float(request.expected_frames[item]),
            int(request.guard_budgets[item]),
            None if audio is None else audio[item],
            None if codec is None else codec.sampling_rate,
            overlong,
        )
        for item in range(input_ids.shape[0])
    ]
    return Drama3GenerationOutput(
        audio_codes=codes,
        sequences=codes,
        lengths=lengths,
        audio=audio,
        finish_reasons=collector.finish_reasons,
        budgets=request.budgets,
        expected_frames=request.expected_frames,
        anomalies=anomalies,
        regenerations=[],
        ras_replacements=sampler.ras_replacements,
        clicks_dropped=clicks_dropped,
        time_to_first_audio=None if waveform_streamer is None else waveform_streamer.time_to_first_audio,
        line_boundaries=collector.line_boundaries,
    )


def put_chunk(streamer, chunk: AudioChunk) -> None:
    """A streamer receives waveform chunks [samples], or frames [1, frames, num_codebooks] without a codec."""
    streamer.put(chunk.audio if chunk.audio is not None else chunk.codes[None])


def decode_audio(codec, codes: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Waveforms of takes: codes [batch, frames, num_codebooks] -> per item [samples]."""
    if codes.shape[1] == 0:
        return [torch.zeros(0, device=codec.device) for _ in range(codes.shape[0])]
    decoded = codec.decode(codes.transpose(1, 2), lengths)
    return [decoded.audio_values[item, : int(decoded.lengths[item])] for item in range(codes.shape[0])]


def _regenerate(model, prompt, request: _Request, seed, codec, output: Drama3GenerationOutput, attempts: int):
    """Regenerate the anomalous takes of `output` up to `attempts` times; a new take replaces the old
    one when it has no more anomalies. Every attempt is recorded in `output.regenerations`."""
    input_ids, audio_codes, attention_mask = prompt
    batch = input_ids.shape[0]
    seeds = None if seed is None else item_seeds(seed, batch)
    takes = [
        [output.audio_codes[item, : int(output.lengths[item])], None if output.audio is None else output.audio[item]]
        for item in range(batch)
    ]
    for attempt in range(1, attempts + 1):
        items = [item for item in range(batch) if output.anomalies[item]]
        if not items:
            break
        index = torch.tensor(items, device=input_ids.device)
        sub_request = request.select(index)
        # attempt n draws with seed + n * SEED_STRIDE: retries differ from the first take yet reproduce
        sub_seed = None if seeds is None else [seeds[item] + attempt * SEED_STRIDE for item in items]
        retry = _run(model, input_ids[index], audio_codes[index], attention_mask[index], sub_request, sub_seed, codec)
        for position, item in enumerate(items):
            kept = len(retry.anomalies[position]) <= len(output.anomalies[item])
            output.regenerations.append(
                {
                    "item": item,
                    "attempt": attempt,
                    "anomalies": list(output.anomalies[item]),
                    "new_anomalies": list(retry.anomalies[position]),
                    "kept": kept,
                }
            )
            if kept:
                length = int(retry.lengths[position])
                takes[item] = [retry.audio_codes[position, :length], None if retry.audio is None else retry.audio[position]]
                output.anomalies[item] = retry.anomalies[position]
                output.finish_reasons[item] = retry.finish_reasons[position]
                output.clicks_dropped[item] = retry.clicks_dropped[position]
                output.ras_replacements[item] = retry.ras_replacements[position]
                output.line_boundaries[item] = retry.line_boundaries[position]
    lengths = torch.tensor([take[0].shape[0] for take in takes], dtype=torch.long, device=input_ids.device)
    codes = input_ids.new_zeros(batch, int(lengths.max()) if batch else 0, model.config.num_codebooks)
    for item, (take_codes, _) in enumerate(takes):
        codes[item, : take_codes.shape[0]] = take_codes
    output.audio_codes = output.sequences = codes
    output.lengths = lengths
    if output.audio is not None:
        output.audio = [take[1] for take in takes]
    return output


@torch.no_grad()
def generate(
    model,
    input_ids=None,
    audio_codes=None,
    attention_mask=None,
    generation_config: GenerationConfig | None = None,
    streamer=None,
    *,
    seed: int | Sequence[int] | None = None,
    preset: str | SamplingSettings | None = None,
    codec=None,
    expected_seconds: float | Sequence[float] | None = None,
    regenerate_on_anomaly: int = 0,
    audio_separator_token_id: int | None = None,
    speak_span: torch.Tensor | None = None,
    boundaries_left: torch.Tensor | None = None,
    threads: int | str | None = "auto",
    **kwargs,
):
    """Speak: prompt rows in, takes out (see the module docstring for the loop and the sampler).

    Args:
        input_ids, audio_codes, attention_mask: the prompt, as the processor returns it (a
            `BatchFeature`, unpacked) or raw rows: `[batch, rows]`, `[batch, rows, num_codebooks]`,
            `[batch, rows]` (left padding).
        generation_config: a `GenerationConfig`; its `do_sample`, `temperature`, `top_p`, `top_k`,
            `repetition_aware` (RAS on the main token, default True), `max_new_tokens` (frames)
            and `return_dict_in_generate` are read.
        streamer: an object with `put(value)` and `end()` (a transformers `BaseStreamer`); batch 1.
            It receives waveform chunks `[samples]` when `codec` is given, else frames
            `[1, frames, num_codebooks]`, as soon as they are final.
        seed: an int (item b uses seed + b) or one per item; each item draws from its own
            generator, so a batch reproduces each prompt alone. None: torch's global generator.
        preset: "serving" (the default settings) or "paper-eval" (0.7 / 0.7 / 30), or settings.
        codec: a `Drama3CodecModel`; the output then carries waveforms.
        expected_seconds: expected duration of each take; default from the text of the turn to
            speak at the model's speaking rate (`text_tokens_per_second`: the generation config's
            `text_tokens_per_second`, else `TOKENS_PER_SECOND`). The frame budget is 2.5x this, at
            most 4096 frames.
        regenerate_on_anomaly: regenerate anomalous takes up to this many times (paper §9).
        audio_separator_token_id: the id of `<|audio_separator|>` (`processor.audio_separator_token_id`;
            default: `audio_separator_token_id` of the generation config or model config). With it,
            a line-by-line prompt (lines separated by the separator in its last user turn) may draw
            the separator between lines, once per line boundary it has left; each one is reported
            in `line_boundaries`. Other prompts never draw it.
        speak_span, boundaries_left: the layout's metadata on the processor's rows (`[batch, 2]`
            rows of the text of the turn to speak, `[batch]` line boundaries still to draw); rows
            given without them are read from their token ids.
        threads: CPU threads to decode with: "auto" (default) picks them from the model's size and
            the idle cores (`threads.decode_threads`), an int is used as given, None leaves torch's
            count alone; torch's count is restored afterwards. "auto" leaves a model on CUDA alone.
        **kwargs: GenerationConfig fields (e.g. `temperature=0.7`, `max_new_tokens=500`).
            `cache_implementation="static"` decodes on preallocated caches with fixed shapes
            (`static_decoding`): the same frames and the same seeded draws as the default dynamic
            cache, one graph per step; it is compiled (`torch.compile(fullgraph=True)`, CUDA graphs)
            by default on CUDA, or wherever `compile_config=CompileConfig(...)` is given, unless
            `disable_compile=True`. The first call of a batch size and cache length class compiles.

    Returns:
        `Drama3GenerationOutput` with `return_dict_in_generate=True`; otherwise the waveforms
        (a list, when `codec` is given) or `audio_codes` `[batch, frames, num_codebooks]`.
    """
    if isinstance(regenerate_on_anomaly, bool) or not isinstance(regenerate_on_anomaly, int) or regenerate_on_anomaly < 0:
        raise ValueError(f"regenerate_on_anomaly={regenerate_on_anomaly!r}; expected 0 (off) or a positive number of attempts")
    if streamer is not None and regenerate_on_anomaly:
        raise ValueError("regenerate_on_anomaly cannot be combined with a streamer: streamed audio cannot be taken back")
    check_threads(threads)
    check_codec_matches(model.config, codec)
    call = _set_up(
        model, input_ids, audio_codes, attention_mask, generation_config, preset, expected_seconds,
        audio_separator_token_id, {"speak_span": speak_span, "boundaries_left": boundaries_left}, kwargs,
        None if streamer is None else "streamer",
    )
    with torch_threads(resolve_threads(model, threads)):
        output = _run(model, *call.prompt, call.request, seed, codec, streamer)
        if regenerate_on_anomaly:
            output = _regenerate(model, call.prompt, call.request, seed, codec, output, regenerate_on_anomaly)
    if call.return_dict:
        return output
    return output.audio if codec is not None else output.audio_codes


@torch.no_grad()
def stream(
    model,
    input_ids=None,
    audio_codes=None,
    attention_mask=None,
    generation_config: GenerationConfig | None = None,
    *,
    seed: int | Sequence[int] | None = None,
    preset: str | SamplingSettings | None = None,
    codec=None,
    expected_seconds: float | None = None,
    windows: Iterator[int] | None = None,
    audio_separator_token_id: int | None = None,
    speak_span: torch.Tensor | None = None,
    boundaries_left: torch.Tensor | None = None,
    threads: int | str | None = "auto",
    **kwargs,
) -> Iterator[AudioChunk]:
    """Speak one prompt and yield `AudioChunk`s as frames are produced.

    With a codec each chunk holds the waveform of a window of frames (10, 10, 12, 32, then 64;
    `windows` overrides the schedule); the chunks concatenate to the offline waveform of the same
    codes. Without a codec each chunk holds one frame's codes. The last chunk has `is_last`.
    `chunk.elapsed` of the first chunk is the time to first audio. A line-by-line prompt reports
    its line boundaries in `chunk.line_boundaries`; together they are `generate`'s. Arguments as
    in `generate`.
    """
    check_threads(threads)
    check_codec_matches(model.config, codec)
    call = _set_up(
        model, input_ids, audio_codes, attention_mask, generation_config, preset, expected_seconds,
        audio_separator_token_id, {"speak_span": speak_span, "boundaries_left": boundaries_left}, kwargs,
        "stream()",
    )
    started = time.perf_counter()
    _, steps = _start(model, *call.prompt, call.request, seed)
    waveform_streamer = WaveformStreamer(codec, started, windows)
    clicks = ClickFilter()
    # torch keeps the count per thread: the caller's code between chunks runs with it too.
    with torch_threads(resolve_threads(model, threads)):
        for step in steps:
            yield from waveform_streamer.step(clicks, step)
        yield from waveform_streamer.finish()


# ----------------------------------------------------------------------------- the model's methods


class Drama3GenerationMixin(GenerationMixin):
    """`generate` and `stream` as methods of `Drama3ForSpeechGeneration`, which inherits them (as
    transformers' CSM model inherits its generation mixin): modeling imports generation, never the
    reverse. The model provides `prefill`, `decode_row`, `tower_step`, `speech_logits`,
    `speech_token_ids` and `is_semantic`."""

    def generate(self, input_ids=None, audio_codes=None, attention_mask=None, generation_config=None, streamer=None, **kwargs):
        """Speak: one prefill, then one decode step per frame. See `generation_drama3.generate`."""
        return generate(self, input_ids, audio_codes, attention_mask, generation_config, streamer, **kwargs)

    def stream(self, input_ids=None, audio_codes=None, attention_mask=None, generation_config=None, **kwargs):
        """Speak one prompt, yielding audio chunks as frames are produced. See `generation_drama3.stream`."""
        return stream(self, input_ids, audio_codes, attention_mask, generation_config, **kwargs)
