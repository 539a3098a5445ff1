"""Phoneme-aligned decoding: a phonetic codec's frames follow the text's phonemes, in order.

A model whose codec codes phonemes (drama3-tiny's `Drama3PhoneCodecModel`: the main code and the
sub-frame codebooks name the phoneme sounding in each spectrogram frame) can be held to its text
while it speaks, as monotonic-alignment decoders do. The model still chooses how long each phoneme
lasts, where it pauses, the voice and every other code; the alignment only removes from each draw
the phonemes that are not where the text stands. A take then cannot loop back over words it has
said, skip more than `skip` phonemes, or end before the last phonemes of its text.

The generation config holds the table (drama3-tiny's recipe learns it from the codes its language
model was trained on: which codes speak each phoneme token of the text):

    "phoneme_alignment": {"codebooks": [0, 2, 3, 4], "silence": 0, "skip": 1, "end_slack": 1,
                          "max_silence": 40, "short_silence": 16, "quiet_tokens": [ids], "max_stay": 48,
                          "resume_after_pause": true, "release": 1.5, "tokens": {"<token id>": [codes, ...], ...}}

`codebooks`: the codebooks that name a phoneme, in spectrogram-frame order, 0 (the main code)
first; `silence`: the silence code; `tokens`: for each phoneme token of the text, the codes that
speak it (text tokens not in the table, such as word boundaries and punctuation, are not aligned
to). A pause lasts at most `max_silence` sub-frames where the text may pause (before the first
phoneme, at punctuation, at a tag, after the last phoneme: any token between two phonemes that is
not in `quiet_tokens`, the word boundary and stress marks), at most `short_silence` inside a word
or between words (a stop's closure), and as long as it likes once eos is allowed. A model whose
text stalls without the alignment tends to fill the pauses it may not end with silence; these caps
keep its pauses where its text has them. `release`: a take that has lasted this many times its
expected duration (the frame budget's expectation) without reaching its end has lost its place for
good; the alignment lets it go (every code and eos allowed) rather than hold it to its budget.
`max_stay`: an item that has stood on one phoneme for this many sub-frames (its pauses included)
before the last phonemes must move on: the phoneme and silence are masked until it does, so a take
that has lost its place cannot stall until its frame budget runs out. `resume_after_pause` false:
after a pause the phoneme before it cannot sound again (a stutter, "t - t - t"); the item goes on.

The state of an item is the text phoneme it stands on. Drawing the code it drew last (silence
aside) keeps it there: the same phoneme is still sounding. Drawing another code moves it to the
first of the next `skip + 1` phonemes that the code speaks, else keeps it where it is (the code
speaks the current phoneme). A code shared by two neighbouring phonemes thus moves forward when it
starts, so a loop cannot hide in it. eos is allowed once the item stands within `end_slack`
phonemes of the last.

`generate()`, `stream()` (eager or compiled: `AlignmentMasks` states the rules on tensors, with
`AlignmentTracker` as its item-by-item reference) and the serving engine apply
the model's table; `phoneme_alignment=False` turns it off for a call. Streaming text input
(`stream_text`) draws freely: its turns hold the next chunk as look-ahead, which is not yet to be
spoken.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from ..prompting.bare_rows import turn_spans

CONFIG_KEY = "phoneme_alignment"


@dataclass(frozen=True)
class PhonemeAlignment:
    """The alignment table of a model (see the module docstring)."""

    tokens: dict[int, frozenset[int]]
    codebooks: tuple[int, ...] = (0,)
    silence: int = 0
    skip: int = 1
    end_slack: int = 1
    max_silence: int = 40
    max_stay: int = 48
    resume_after_pause: bool = True
    short_silence: int | None = None
    quiet_tokens: frozenset[int] = frozenset()
    release: float | None = None

    @classmethod
    def from_value(cls, value, codebook_size: int, num_codebooks: int) -> PhonemeAlignment:
        """Read and check a `phoneme_alignment` value (a dict, as saved in generation_config.json)."""
        where = CONFIG_KEY
        if isinstance(value, PhonemeAlignment):
            value = value.to_dict()
        if not isinstance(value, dict):
            raise ValueError(f"{where}={value!r}; expected a dict with 'tokens' (or False to turn it off)")
        unknown = sorted(set(value) - {"tokens", "codebooks", "silence", "skip", "end_slack", "max_silence", "max_stay", "resume_after_pause",
                              "short_silence", "quiet_tokens", "release"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}")

        def count(name, default, low):
            number = value.get(name, default)
            if isinstance(number, bool) or not isinstance(number, int) or number < low:
                raise ValueError(f"{where}.{name}={number!r}; expected an integer >= {low}")
            return number

        codebooks = value.get("codebooks", [0])
        if (
            not isinstance(codebooks, (list, tuple)) or not codebooks or codebooks[0] != 0
            or any(isinstance(c, bool) or not isinstance(c, int) for c in codebooks)
            or list(codebooks) != sorted(set(codebooks)) or codebooks[-1] >= num_codebooks
        ):
            raise ValueError(
                f"{where}.codebooks={codebooks!r}; expected increasing codebook indices starting with 0, "
                f"below {num_codebooks}"
            )
        resume = value.get("resume_after_pause", True)
        if not isinstance(resume, bool):
            raise ValueError(f"{where}.resume_after_pause={resume!r}; expected true or false")
        quiet = value.get("quiet_tokens", [])
        if not isinstance(quiet, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in quiet):
            raise ValueError(f"{where}.quiet_tokens={quiet!r}; expected a list of token ids")
        short = value.get("short_silence")
        if short is not None and (isinstance(short, bool) or not isinstance(short, int) or short < 1):
            raise ValueError(f"{where}.short_silence={short!r}; expected an integer >= 1")
        release = value.get("release")
        if release is not None and (isinstance(release, bool) or not isinstance(release, (int, float)) or not release > 1):
            raise ValueError(f"{where}.release={release!r}; expected a number above 1 (times the expected duration)")
        silence = count("silence", 0, 0)
        if silence >= codebook_size:
            raise ValueError(f"{where}.silence={silence}; expected a code below {codebook_size}")
        table = value.get("tokens")
        if not isinstance(table, dict) or not table:
            raise ValueError(f"{where}.tokens: expected a non-empty dict of token id -> codes")
        tokens = {}
        for token, codes in table.items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.tokens: key {token!r} is not a token id") from None
            if (
                not isinstance(codes, (list, tuple)) or not codes
                or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < codebook_size for c in codes)
            ):
                raise ValueError(f"{where}.tokens[{token!r}]={codes!r}; expected a non-empty list of codes below {codebook_size}")
            tokens[token_id] = frozenset(codes)
        return cls(
            tokens, tuple(codebooks), silence, count("skip", 1, 0), count("end_slack", 1, 0),
            count("max_silence", 40, 1),
            count("max_stay", 48, 1),
            resume,
            short,
            frozenset(quiet),
            None if release is None else float(release),
        )

    def to_dict(self) -> dict:
        return {
            "codebooks": list(self.codebooks), "silence": self.silence, "skip": self.skip,
            "end_slack": self.end_slack, "max_silence": self.max_silence, "max_stay": self.max_stay,
            "resume_after_pause": self.resume_after_pause, "quiet_tokens": sorted(self.quiet_tokens),
            **({} if self.short_silence is None else {"short_silence": self.short_silence}),
            **({} if self.release is None else {"release": self.release}),
            "tokens": {str(token): sorted(codes) for token, codes in sorted(self.tokens.items())},
        }

    def rows(self, token_ids) -> list[frozenset[int]]:
        """The code sets of the phoneme tokens among `token_ids`, in order."""
        return [self.tokens[int(token)] for token in token_ids if int(token) in self.tokens]

    def pause_points(self, token_ids) -> list[bool]:
        """Per phoneme of `token_ids` (as `rows`): whether the text may pause after it (a token that
        is neither a phoneme nor in `quiet_tokens` before the next phoneme, or none follows)."""
        points, pause = [], False
        for token in map(int, token_ids):
            if token in self.tokens:
                if points:
                    points[-1] = pause
                points.append(True)
                pause = False
            elif token not in self.quiet_tokens:
                pause = True
        return points


def resolve_alignment(model, sources) -> PhonemeAlignment | None:
    """The call's alignment: `phoneme_alignment` of the model's generation config, then of each
    source (a GenerationConfig or a dict of keyword arguments), the last set one winning; False or
    None in a later source turns it off, True keeps the model's."""
    value = None
    model_value = getattr(getattr(model, "generation_config", None), CONFIG_KEY, None)
    for source in (getattr(model, "generation_config", None), *sources):
        if source is None:
            continue
        if isinstance(source, dict):
            if CONFIG_KEY not in source:
                continue
            found = source[CONFIG_KEY]
        else:
            if CONFIG_KEY not in vars(source):
                continue
            found = getattr(source, CONFIG_KEY)
        if found is True:
            if model_value in (None, False):
                raise ValueError(f"{CONFIG_KEY}=True, but this model's generation config has no alignment table")
            found = model_value
        value = found
    if value is None or value is False:
        return None
    config = model.config
    return PhonemeAlignment.from_value(value, config.codebook_size, config.num_codebooks)


def turn_token_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor, eos_token_id: int, speak_span=None) -> list[list[int]]:
    """The text rows of the turn to speak, per prompt: `speak_span` [batch, 2] when the processor
    gave it, else the rows between the last two `<|im_end|>` (all rows when there are fewer)."""
    spans = torch.as_tensor(speak_span) if speak_span is not None else turn_spans(input_ids, attention_mask, eos_token_id)[0]
    return [input_ids[item, int(start) : int(stop)].tolist() for item, (start, stop) in enumerate(spans.tolist())]


class _HeadDraws:
    """What both forms of the alignment do with a codebook head: restrict it where the codebook
    names a phoneme, and follow the codes drawn there (`allowed` and `observe` are each form's)."""

    def codebook_logits(self, logits: torch.Tensor, codebook_index: int) -> torch.Tensor:
        """Head logits [batch, 1, codebook_size], restricted when the codebook names a phoneme."""
        if codebook_index not in self.alignment.codebooks[1:]:
            return logits
        return logits.masked_fill(~self.allowed()[:, None, :].to(logits.device), float("-inf"))

    def draw_code(self, draw, logits: torch.Tensor, codebook_index: int, drawing: torch.Tensor) -> torch.Tensor:
        """`draw(logits)` -> codes [batch, 1] of one head, drawn within the alignment, which then
        follows the drawn codes of a phoneme codebook (`drawing` [batch]: the items that draw)."""
        codes = draw(self.codebook_logits(logits, codebook_index))
        if codebook_index in self.alignment.codebooks:
            self.observe(codes[:, 0], drawing)
        return codes


class AlignmentTracker(_HeadDraws):
    """Where each item of a decode run stands in its text, and which codes it may draw there.

    alignment: the table; token_ids: per item the text rows of its turn to speak (its phonemes are
    `alignment.rows` of them); an item without phonemes is not constrained."""

    def __init__(self, alignment: PhonemeAlignment, token_ids: list[list[int]], codebook_size: int,
                 expected_frames=None):
        self.alignment = alignment
        self.token_ids = token_ids
        self.expected_frames = None if expected_frames is None else [float(f) for f in expected_frames]
        self.sub_frames = [0] * len(token_ids)
        self.rows = [alignment.rows(ids) for ids in token_ids]
        self.pauses = [alignment.pause_points(ids) for ids in token_ids]
        self.codebook_size = codebook_size
        self.state = [-1] * len(token_ids)
        self.silent_run = [0] * len(token_ids)
        self.last_code: list[int | None] = [None] * len(token_ids)
        self.stay = [0] * len(token_ids)

    def select(self, index) -> AlignmentTracker:
        """A fresh tracker for the items `index` (a regeneration of some of them)."""
        index = [int(item) for item in index]
        expected = None if self.expected_frames is None else [self.expected_frames[item] for item in index]
        return AlignmentTracker(self.alignment, [self.token_ids[item] for item in index], self.codebook_size, expected)

    _PER_ITEM = ("token_ids", "sub_frames", "rows", "pauses", "state", "silent_run", "last_code", "stay")

    def take(self, items) -> AlignmentTracker:
        """The items `items` (in that order) where they stand: the serving engine's running
        requests after some left."""
        items = [int(item) for item in items]
        taken = AlignmentTracker.__new__(AlignmentTracker)
        taken.alignment, taken.codebook_size = self.alignment, self.codebook_size
        taken.expected_frames = None if self.expected_frames is None else [self.expected_frames[i] for i in items]
        for name in self._PER_ITEM:
            setattr(taken, name, [getattr(self, name)[i] for i in items])
        return taken

    def joined(self, other: AlignmentTracker | None) -> AlignmentTracker:
        """These items, then `other`'s, where each stands (an engine's request joining the batch)."""
        if other is None:
            raise ValueError("a request without phoneme alignment cannot join aligned ones")
        joined = self.take(range(len(self.rows)))
        if (self.expected_frames is None) != (other.expected_frames is None):
            raise ValueError("joined trackers must both know their expected frames, or neither")
        if joined.expected_frames is not None:
            joined.expected_frames += other.expected_frames
        for name in self._PER_ITEM:
            getattr(joined, name).extend(getattr(other, name))
        return joined

    def released(self, item: int) -> bool:
        """The item has outlasted `release` times its expected frames: it is no longer held."""
        if self.alignment.release is None or self.expected_frames is None:
            return False
        limit = self.alignment.release * self.expected_frames[item] * len(self.alignment.codebooks)
        return self.sub_frames[item] >= limit

    def _window(self, item: int) -> range:
        last = len(self.rows[item]) - 1
        return range(max(self.state[item], 0), min(self.state[item] + 1 + self.alignment.skip, last) + 1)

    def may_end(self, item: int) -> bool:
        return not self.rows[item] or self.released(item) or self.state[item] >= len(self.rows[item]) - 1 - self.alignment.end_slack

    def silence_cap(self, item: int) -> int:
        """How many sub-frames of silence in a row the item may draw where it stands."""
        state = self.state[item]
        if self.alignment.short_silence is None or state < 0 or self.pauses[item][state]:
            return self.alignment.max_silence
        return self.alignment.short_silence

    def pushed(self, item: int) -> bool:
        """The item has stood on its phoneme for `max_stay` sub-frames before the end: it must move on."""
        return (not self.may_end(item) and self.stay[item] >= self.alignment.max_stay
                and self.state[item] < len(self.rows[item]) - 1)

    def allowed(self) -> torch.Tensor:
        """[batch, codebook_size] the codes each item may draw next."""
        allowed = torch.zeros(len(self.rows), self.codebook_size, dtype=torch.bool)
        for item, rows in enumerate(self.rows):
            if not rows or self.released(item):
                allowed[item] = True
                continue
            pushed = self.pushed(item)
            paused = (not self.alignment.resume_after_pause and self.silent_run[item] > 0
                      and self.state[item] >= 0 and self.state[item] < len(rows) - 1)
            for position in self._window(item):
                if not ((pushed or paused) and position == max(self.state[item], 0)):
                    allowed[item, list(rows[position])] = True
            if self.may_end(item) or (self.silent_run[item] < self.silence_cap(item) and not pushed):
                allowed[item, self.alignment.silence] = True
        return allowed

    def main_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Restricted main logits [batch, 1, codebook_size + 1 (+ separator)]: codes not allowed and
        eos before the end get -inf (the separator column is left as it is)."""
        keep = torch.ones(logits.shape[0], logits.shape[-1], dtype=torch.bool)
        keep[:, : self.codebook_size] = self.allowed()
        keep[:, self.codebook_size] = torch.tensor([self.may_end(item) for item in range(len(self.rows))])
        return logits.masked_fill(~keep[:, None, :].to(logits.device), float("-inf"))

    def observe(self, codes: torch.Tensor, drawing: torch.Tensor) -> None:
        """Move each drawing item ([batch] bool) along its text by its drawn code ([batch])."""
        for item, (code, draws) in enumerate(zip(codes.tolist(), drawing.tolist())):
            if not draws or not self.rows[item]:
                continue
            self.sub_frames[item] += 1
            pushed = self.pushed(item)
            self.stay[item] += 1
            if code == self.alignment.silence:
                self.silent_run[item] += 1
                continue
            paused = not self.alignment.resume_after_pause and self.silent_run[item] > 0
            self.silent_run[item] = 0
            rows, state = self.rows[item], self.state[item]
            if pushed or paused or code != self.last_code[item]:  # the same code again: the same phoneme, still sounding
                ahead = [position for position in self._window(item) if position > state and code in rows[position]]
                if ahead:
                    self.state[item] = ahead[0]
                    self.stay[item] = 0
            self.last_code[item] = code


def draw_within(aligner: AlignmentTracker | None, draw, logits: torch.Tensor, codebook_index: int,
                drawing: torch.Tensor) -> torch.Tensor:
    """`draw(logits)` -> codes [batch, 1] of one head: as drawn without an aligner, else within its
    alignment (`AlignmentTracker.draw_code`)."""
    return draw(logits) if aligner is None else aligner.draw_code(draw, logits, codebook_index, drawing)


class AlignmentMasks(_HeadDraws):
    """`AlignmentTracker`'s rules on tensors of fixed shape: the alignment the decode step runs.

    Every item's phonemes are one row of `table` [batch, phonemes, codebook_size] (the codes that
    speak each phoneme), and where it stands (`position`, -1 before the first phoneme), how long it
    has been silent, its last code, how long it has stood on its phoneme and how many sub-frames it
    has drawn are tensors [batch]. `allowed()` and `observe()` compute what the tracker computes
    item by item, with masks and gathers: no branch reads a tensor, so a compiled step holds the
    alignment in its graph. `AlignmentTracker` stays its reference (tests/test_phoneme_alignment.py)."""

    def __init__(self, alignment: PhonemeAlignment, token_ids: list[list[int]], codebook_size: int,
                 expected_frames=None, device=None):
        self.alignment, self.codebook_size = alignment, codebook_size
        self.token_ids = [list(ids) for ids in token_ids]
        self.expected_frames = None if expected_frames is None else [float(frames) for frames in expected_frames]
        rows = [alignment.rows(ids) for ids in self.token_ids]
        pauses = [alignment.pause_points(ids) for ids in self.token_ids]
        batch, width = len(rows), max([1, *(len(phonemes) for phonemes in rows)])
        self.table = torch.zeros(batch, width, codebook_size, dtype=torch.bool)
        self.pauses = torch.zeros(batch, width, dtype=torch.bool)
        for item, (phonemes, points) in enumerate(zip(rows, pauses)):
            for position, codes in enumerate(phonemes):
                self.table[item, position, sorted(codes)] = True
            self.pauses[item, : len(points)] = torch.tensor(points, dtype=torch.bool)
        self.lengths = torch.tensor([len(phonemes) for phonemes in rows], dtype=torch.long)
        limits = [math.inf] * batch
        if alignment.release is not None and self.expected_frames is not None:
            limits = [alignment.release * frames * len(alignment.codebooks) for frames in self.expected_frames]
        self.limits = torch.tensor(limits, dtype=torch.float64)
        self.position = torch.full((batch,), -1, dtype=torch.long)
        self.silent_run = torch.zeros(batch, dtype=torch.long)
        self.last_code = torch.full((batch,), -1, dtype=torch.long)  # -1: none yet (never a code)
        self.stay = torch.zeros(batch, dtype=torch.long)
        self.sub_frames = torch.zeros(batch, dtype=torch.long)
        if device is not None:
            self._map(lambda tensor: tensor.to(device))

    _TENSORS = ("table", "pauses", "lengths", "limits", "position", "silent_run", "last_code", "stay", "sub_frames")
    _STATE = ("position", "silent_run", "last_code", "stay", "sub_frames")

    def _map(self, function, names=_TENSORS) -> None:
        for name in names:
            setattr(self, name, function(getattr(self, name)))

    # -- items: fresh runs, the engine's batch ------------------------------------------------------

    def select(self, index) -> AlignmentMasks:
        """A fresh alignment for the items `index` (a regeneration of some of them)."""
        index = [int(item) for item in index]
        expected = None if self.expected_frames is None else [self.expected_frames[item] for item in index]
        return AlignmentMasks(self.alignment, [self.token_ids[item] for item in index], self.codebook_size, expected,
                              self.table.device)

    def take(self, items) -> AlignmentMasks:
        """The items `items` (in that order) where they stand."""
        items = [int(item) for item in items]
        taken = copy.copy(self)
        taken.token_ids = [self.token_ids[item] for item in items]
        taken.expected_frames = None if self.expected_frames is None else [self.expected_frames[item] for item in items]
        index = torch.tensor(items, dtype=torch.long, device=self.table.device)
        taken._map(lambda tensor: tensor.index_select(0, index))
        return taken

    def joined(self, other: AlignmentMasks | None) -> AlignmentMasks:
        """These items, then `other`'s, where each stands."""
        if other is None:
            raise ValueError("a request without phoneme alignment cannot join aligned ones")
        if (self.expected_frames is None) != (other.expected_frames is None):
            raise ValueError("joined alignments must both know their expected frames, or neither")
        joined = copy.copy(self)
        joined.token_ids = self.token_ids + other.token_ids
        joined.expected_frames = None if self.expected_frames is None else self.expected_frames + other.expected_frames
        width = max(self.table.shape[1], other.table.shape[1])
        for name in self._TENSORS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name in ("table", "pauses"):
                mine, theirs = (torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[1]) if t.dim() == 3 else (0, width - t.shape[1]))
                                for t in (mine, theirs))
            setattr(joined, name, torch.cat((mine, theirs)))
        return joined

    def blank(self, count: int) -> AlignmentMasks:
        """`count` items without a text (never constrained): the engine's items that hold no request."""
        expected = None if self.expected_frames is None else [1.0] * count
        return AlignmentMasks(self.alignment, [[] for _ in range(count)], self.codebook_size, expected, self.table.device)

    def owned(self) -> None:
        """Copy the state out of a compiled graph's memory (the next replay reuses it)."""
        self._map(torch.clone, self._STATE)

    # -- the rules ----------------------------------------------------------------------------------

    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [batch, skip + 2] of the window each item may draw from, which of them are in it)."""
        start = self.position.clamp(min=0)
        positions = start[:, None] + torch.arange(self.alignment.skip + 2, device=start.device)
        end = torch.minimum(self.position + 1 + self.alignment.skip, self.lengths - 1)
        return positions.clamp(max=self.table.shape[1] - 1), positions <= end[:, None]

    def _released(self) -> torch.Tensor:
        return self.sub_frames.double() >= self.limits

    def may_end_mask(self) -> torch.Tensor:
        return (self.lengths == 0) | self._released() | (self.position >= self.lengths - 1 - self.alignment.end_slack)

    def _pushed(self) -> torch.Tensor:
        return ~self.may_end_mask() & (self.stay >= self.alignment.max_stay) & (self.position < self.lengths - 1)

    def _silence_cap(self) -> torch.Tensor:
        alignment = self.alignment
        if alignment.short_silence is None:
            return torch.full_like(self.position, alignment.max_silence)
        at_pause = self.pauses.gather(1, self.position.clamp(min=0)[:, None])[:, 0]
        return torch.where((self.position < 0) | at_pause, alignment.max_silence, alignment.short_silence)

    def allowed(self) -> torch.Tensor:
        """[batch, codebook_size] the codes each item may draw next."""
        alignment = self.alignment
        positions, valid = self._window()
        pushed = self._pushed()
        paused = (self.silent_run > 0) & (self.position >= 0) & (self.position < self.lengths - 1)
        if alignment.resume_after_pause:
            paused = torch.zeros_like(paused)
        current = positions == self.position.clamp(min=0)[:, None]
        use = valid & ~((pushed | paused)[:, None] & current)
        window = self.table.gather(1, positions[:, :, None].expand(-1, -1, self.codebook_size))
        allowed = (window & use[:, :, None]).any(dim=1)
        silence = self.may_end_mask() | ((self.silent_run < self._silence_cap()) & ~pushed)
        codes = torch.arange(self.codebook_size, device=allowed.device)
        allowed = allowed | ((codes == alignment.silence)[None] & silence[:, None])
        return allowed | ((self.lengths == 0) | self._released())[:, None]

    def main_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Restricted main logits [batch, 1, codebook_size + 1 (+ separator)]: codes not allowed and
        eos before the end get -inf (the separator column is left as it is)."""
        size = self.codebook_size
        keep = torch.cat((self.allowed(), self.may_end_mask()[:, None]), dim=-1)
        keep = torch.nn.functional.pad(keep, (0, logits.shape[-1] - size - 1), value=True)
        return logits.masked_fill(~keep[:, None, :], float("-inf"))

    def observe(self, codes: torch.Tensor, drawing: torch.Tensor) -> None:
        """Move each drawing item ([batch] bool) along its text by its drawn code ([batch])."""
        alignment = self.alignment
        acting = drawing & (self.lengths > 0)
        self.sub_frames = self.sub_frames + acting.long()
        pushed = self._pushed()
        self.stay = self.stay + acting.long()
        silent = codes == alignment.silence
        sounding = acting & ~silent
        paused = (self.silent_run > 0) & torch.tensor(not alignment.resume_after_pause, device=codes.device)
        self.silent_run = torch.where(acting & silent, self.silent_run + 1, torch.where(sounding, 0, self.silent_run))
        positions, valid = self._window()
        speaks = self.table.gather(1, positions[:, :, None].expand(-1, -1, self.codebook_size))
        speaks = speaks.gather(2, codes.clamp(0, self.codebook_size - 1)[:, None, None].expand(-1, positions.shape[1], 1))[..., 0]
        ahead = valid & (positions > self.position[:, None]) & speaks
        first = positions.gather(1, ahead.long().argmax(dim=1, keepdim=True))[:, 0]
        moved = sounding & (pushed | paused | (codes != self.last_code)) & ahead.any(dim=1)
        self.position = torch.where(moved, first, self.position)
        self.stay = torch.where(moved, 0, self.stay)
        self.last_code = torch.where(sounding, codes, self.last_code)
