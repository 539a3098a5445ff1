"""Every per-request option, defined once: its name, type, range, default and help, and the doors
that offer it. Each door is derived from these entries, not listed by hand:

    generate   `generate()` / `stream()` / `stream_text()` keyword arguments and GenerationConfig
               fields (`generation.arguments` accepts the schema's fields, refuses the others)
    http       the body of `POST /v1/audio/speech` (`serving.protocol`)
    stream     the `start` message of the WebSocket text stream (`serving.protocol`)
    cli        the flags of `drama3 say` (and, for the sampling entries, `drama3 eval`)
    demo       the fields of the demo's sampling panel (`serving.demo`)

`check_options` is the one check of option values: every door runs it, so a value is refused
everywhere with the same words, naming the option ("top_p=0; expected ..."); a door only says
where the option came from (a flag, a field, a widget). A request's sampling options become one
`SamplingSettings`, which the decode reads; the rest go to the resolver (`decoding.request`).

Some options are the server's own, not the decode's (`decode=False`): the voice that speaks and
the answer's audio (`voice`, `response_format`, `speed`, `sample_rate`). Their entries give the
HTTP body and the text stream's `start` message their type, range or choices, default and help;
the door reads them itself (`serving.protocol`) and never hands them to the resolver, and what
only the server knows stays the door's check (whether a voice exists, whether this server can
encode a format). No door of the decode (`generate`, `cli`, `demo`) offers them.

This module imports only the standard library: the console script reads it to build `drama3`'s
flags before torch is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

GENERATE, HTTP, STREAM, CLI, DEMO = "generate", "http", "stream", "cli", "demo"
EVERY_DOOR = frozenset({GENERATE, HTTP, STREAM, CLI, DEMO})

MAX_TEMPERATURE = 10.0
"""The highest temperature any door takes (past it every draw is near uniform noise)."""
MAX_TOP_K = 1_000_000
"""The highest top-k any door takes (beyond any vocabulary; 0 or None: no top-k)."""
MAX_SEED = 2**63 - 1
"""Seeds are 64-bit (both halves go into an item's key)."""
MIN_SPEED, MAX_SPEED = 0.25, 4.0
"""The time-stretch factors the server applies (`serving.output_audio.stretch`'s range)."""
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 48000
"""The `sample_rate` a request may ask for (telephony's 8 kHz to 48 kHz)."""
AUDIO_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
"""Every `response_format` the protocol knows (OpenAI's); which of them this server can encode is
its own check (`serving.audio_formats.supported_formats`)."""


@dataclass(frozen=True)
class Option:
    """One per-request option.

    Args:
        name: the option's name in Python and JSON (`top_p`); a door says it its own way (`--top-p`).
        kind: `bool`, `int`, `float` or `str` (an int is a float's value too; a bool is never a number).
        default: what applies when nothing sets it (None: no value; the model's generation config or
            the resolver decides).
        help: what it does, in one sentence (the CLI's help, the API's description).
        low, high: the range of a number (None: open on that side); `low_open`: `low` itself refused.
        choices: the values a `str` takes.
        doors: where it is offered (`EVERY_DOOR` or a subset).
        sampling: a field of `SamplingSettings` (how tokens are drawn).
        decode: read by the decode (the resolver, `decoding.request`); False: the server's own
            (the voice, the answer's audio), read by its door and never passed on.
        note: words after the expected range in an error ("0 is greedy").
        flag: the CLI flag when it is not `--name` with dashes; label: how the demo names it;
        unset: what applies when a door leaves it empty ("the preset's").
    """

    name: str
    kind: type
    default: object
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple = ()
    doors: frozenset = EVERY_DOOR
    sampling: bool = False
    decode: bool = True
    note: str = ""
    flag: str | None = None
    label: str | None = None
    unset: str = "the model's"

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def demo_label(self) -> str:
        return self.label or self.name

    def expected(self) -> str:
        """What a value must be, in words ("a finite number in (0, 1]")."""
        if self.kind is bool:
            return "True or False"
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.kind is str:
            return "a string"
        what = "an integer" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            words = f"{what} in {'(' if self.low_open else '['}{_shown(self.low)}, {_shown(self.high)}]"
        elif self.kind is int and self.low in (0, 1) and not self.low_open:
            words = "a positive integer" if self.low == 1 else "0 or a positive integer"
        elif self.low is not None:
            words = f"{what} {'>' if self.low_open else '>='} {_shown(self.low)}"
        else:
            words = what
        return f"{words} ({self.note})" if self.note else words

    def accepts(self, value) -> bool:
        """Whether `value` (not None) is a value of this option."""
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        kinds = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value <= self.high

    def check(self, value, where: str = "") -> None:
        """Refuse a value this option does not take (None: unset, always taken); the message names
        the option (`where` prefixes it: "generation_config.")."""
        if value is not None and not self.accepts(value):
            raise ValueError(f"{where}{self.name}={value!r}; expected {self.expected()}")


def _shown(number) -> str:
    """A bound as a person writes it: 10 for 10.0, 1000000 for 1e6."""
    return str(int(number)) if isinstance(number, int) or float(number).is_integer() else f"{number:g}"


# ----------------------------------------------------------------------------- the schema

SCHEMA: tuple[Option, ...] = (
    Option("seed", int, None, "the seed of the take's random numbers: the same seed draws the same take",
           low=0, high=MAX_SEED, label="Seed", unset="random"),
    Option("do_sample", bool, True, "False draws every token by argmax (no repetition-aware sampling)",
           doors=frozenset({GENERATE}), sampling=True),
    Option("temperature", float, 1.0, "divides the logits before top-p, for the main token and the codebook heads",
           low=0, high=MAX_TEMPERATURE, note="0 is greedy", sampling=True, label="Temperature", unset="the preset's"),
    Option("top_p", float, 0.9, "nucleus mass kept for the main token and the codebook heads (1.0: off)",
           low=0, high=1, low_open=True, sampling=True, label="Top-p", unset="the preset's"),
    Option("top_k", int, None, "candidates kept for the main token (0: all); the codebook heads keep at most 30",
           low=0, high=MAX_TOP_K, note="0: no top-k", sampling=True, label="Top-k", unset="the preset's"),
    Option("min_p", float, 0.0,
           "after top-k and top-p, drops the candidates less likely than min_p times the likeliest one, for the main "
           "token and the codebook heads", low=0, high=1, note="0: off", sampling=True, label="Min-p", unset="0, off"),
    Option("repetition_aware", bool, True,
           "repetition-aware sampling (RAS) of the main token: a semantic draw that repeats one of the last 16 "
           "main tokens is drawn again at temperature 1.0, top-p 0.95, top-k 30",
           doors=frozenset({GENERATE, CLI}), sampling=True, flag="--ras"),
    Option("max_new_tokens", int, None, "frames a take may make at most (its budget from the text caps it too)",
           low=1, note="frames", flag="--max-frames", label="Max frames per request", unset="the model's budget"),
    Option("expected_seconds", float, None,
           "the take's expected duration, which sets its frame budget (2.5x) and guards (default: from its text)",
           low=0, low_open=True, doors=frozenset({GENERATE})),
    Option("phoneme_alignment", bool, None,
           "phoneme-aligned decoding, where the model's generation config holds an alignment table",
           doors=frozenset({GENERATE, CLI}), flag="--alignment"),
    Option("audio_separator_token_id", int, None,
           "the id of <|audio_separator|>: a line-by-line prompt draws it between its lines (default: the config's)",
           low=0, doors=frozenset({GENERATE})),
    Option("preset", str, None, "a sampling preset in place of the model's generation config",
           choices=("serving", "paper-eval"), doors=frozenset({GENERATE, CLI}), unset="the model's generation config"),
    Option("regenerate_on_anomaly", int, 0, "regenerate anomalous takes up to N times (0: never)",
           low=0, doors=frozenset({GENERATE, CLI}), flag="--regenerate", unset="0"),
    Option("voice", str, None,
           "the voice that speaks: a stored voice, a fine-tuned (adapter) voice or an alias, by id (whether it exists "
           "is the server's check)", doors=frozenset({HTTP, STREAM}), decode=False, unset="the server's default voice"),
    Option("response_format", str, "mp3",
           "the answer's audio format (a text stream sends pcm or wav); mp3, opus, aac and flac need PyAV on the server",
           choices=AUDIO_FORMATS, doors=frozenset({HTTP, STREAM}), decode=False,
           unset="mp3, or pcm with stream: true (wav where mp3 cannot be written; a text stream: pcm)"),
    Option("speed", float, 1.0,
           "time-stretches the answer's audio without changing its pitch (1.0: as spoken; other values need PyAV on "
           "the server)", low=MIN_SPEED, high=MAX_SPEED, doors=frozenset({HTTP}), decode=False, unset="1.0"),
    Option("sample_rate", int, None, "the rate of pcm or wav audio (the other formats are coded at their own)",
           low=MIN_SAMPLE_RATE, high=MAX_SAMPLE_RATE, doors=frozenset({HTTP}), decode=False,
           unset="pcm 24 kHz, wav the model's rate"),
)
"""Every per-request option, in the order doors show them."""

OPTIONS: dict[str, Option] = {option.name: option for option in SCHEMA}


def options_for(door: str, decode: bool | None = None) -> tuple[Option, ...]:
    """The options a door offers, in the schema's order; `decode` True or False: only those the
    decode reads, or only the server's own (None: both)."""
    if door not in EVERY_DOOR:
        raise ValueError(f"door={door!r}; expected one of {sorted(EVERY_DOOR)}")
    return tuple(option for option in SCHEMA if door in option.doors and decode in (None, option.decode))


SAMPLING_NAMES: tuple[str, ...] = tuple(option.name for option in SCHEMA if option.sampling)
"""The options that are fields of `SamplingSettings`."""


def check_options(values: dict, where: str = "") -> None:
    """The one check of option values: every value of `values` (name -> value) that names an option
    and is not None is checked against its entry; a ValueError names the first one refused
    ("top_p=0; expected a finite number in (0, 1]"). Other names are left to their readers."""
    for name, value in values.items():
        option = OPTIONS.get(name)
        if option is not None:
            option.check(value, where)


# ----------------------------------------------------------------------------- sampling settings


CODEBOOK_TOP_K = 30
"""The codebook heads never keep more than this many candidates."""


@dataclass(frozen=True)
class SamplingSettings:
    """How frames are drawn: the schema's sampling options (`SAMPLING_NAMES`), checked.

    Args:
        do_sample: False draws every token by argmax (no RAS).
        temperature: divides the logits before top-p, for the main token and the codebook heads.
        top_p: nucleus mass for the main token and the codebook heads (1.0: off).
        top_k: candidates kept for the main token (None: all); the codebook heads keep
            `min(top_k, 30)`.
        min_p: after top-k and top-p, candidates whose probability (at `temperature`) is below
            `min_p` times the likeliest one's are dropped, for the main token and the codebook
            heads (0: off).
        repetition_aware: apply RAS to the main token. A generation config may set it
            (`repetition_aware: false`): a model whose main tokens repeat by design, such as
            drama3-tiny's phonetic codes (one phoneme spans several frames), turns RAS off there.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int | None = None
    min_p: float = 0.0
    repetition_aware: bool = True

    def __post_init__(self):
        check_options({field.name: getattr(self, field.name) for field in fields(self)})

    @property
    def codebook_top_k(self) -> int:
        return CODEBOOK_TOP_K if self.top_k is None else min(self.top_k, CODEBOOK_TOP_K)


SERVING_DEFAULTS = SamplingSettings()
"""The published serving defaults: temperature 1.0, top-p 0.9, main token uncapped."""
PAPER_EVALUATION = SamplingSettings(temperature=0.7, top_p=0.7, top_k=30)
"""The paper's evaluation setting (temperature 0.7, top-p 0.7, top-k 30). Capping the main token
at 30 candidates makes takes without a reference go silent more often (spec §5)."""
PRESETS = {"serving": SERVING_DEFAULTS, "paper-eval": PAPER_EVALUATION}
"""The sampling presets, by the names the `preset` option takes."""
