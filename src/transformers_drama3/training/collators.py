"""Collators: prepared examples -> labelled training rows in the published layout.

Every collator turns each example into a request of the processor (`Script`, `LineByLineScript`,
`Infill`, see the `prompting` package) and lets the processor build the rows and the label mask, so the
training rows are token for token what generation sees. The output feeds
`Drama3ForSpeechGeneration.forward` directly: `input_ids`, `audio_codes`, `attention_mask`,
`labels` (right padding). Labels supervise only the model's own output (the target audio, its
learned separators and the closing `<|im_end|>`), never references or history takes.

Examples are dicts as `prepare_dataset` writes them: `text`, `codes` ([num_codebooks][frames]),
`speaker`, plus what a task needs (see each collator). Use `remove_unused_columns=False` in
`TrainingArguments`, so `Trainer` hands these columns to the collator.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any, Sequence

import torch

from ..decoding.sampler import SEED_STRIDE
from ..prompting import Infill, Line, LineByLineScript, PromptRows, Reference, Script, StreamingScript, Take

DEFAULT_SEAM_FRAMES = 4
DEFAULT_SEAM_WEIGHT = 2.0


def as_codes(value: Any) -> torch.Tensor:
    """Codes from a dataset cell ([num_codebooks][frames] lists) or a tensor -> long [num_codebooks, frames]."""
    return torch.as_tensor(value, dtype=torch.long)


class ReferencePool:
    """Utterances grouped by speaker, to draw cloning references from.

    Args:
        dataset: rows with `speaker`, `text`, `codes` (a `datasets.Dataset` or a list of dicts).
        max_reference_frames: references are cut to their first this many frames.
    """

    def __init__(self, dataset, max_reference_frames: int | None = None):
        self.dataset = dataset
        self.max_reference_frames = max_reference_frames
        self.by_speaker: dict[str, list[int]] = defaultdict(list)
        for index, speaker in enumerate(dataset["speaker"] if hasattr(dataset, "column_names") else [r["speaker"] for r in dataset]):
            self.by_speaker[str(speaker)].append(index)

    def others(self, speaker: str, exclude: int) -> list[int]:
        """Indices of the speaker's utterances other than `exclude` (the target itself)."""
        return [index for index in self.by_speaker.get(str(speaker), []) if index != exclude]

    def reference(self, index: int, speaker_slot: int = 0) -> Reference:
        row = self.dataset[index]
        codes = as_codes(row["codes"])
        if self.max_reference_frames is not None:
            codes = codes[:, : self.max_reference_frames]
        return Reference(transcript=row["text"], audio=codes, speaker=speaker_slot)


class RowCollator:
    """Base: `request(example, position)` builds the processor request of one example.

    Args:
        processor: a `Drama3Processor` (tokenizer; a codec is not needed for codes).
        max_rows: examples longer than this are cut on the right (their labels with them).
        seed: examples draw their random choices (references, windows) from `seed` and their
            `index`, so a batch is the same whichever process or epoch builds it.
    """

    def __init__(self, processor, max_rows: int | None = None, seed: int = 0):
        self.processor = processor
        self.max_rows = max_rows
        self.seed = seed

    def request(self, example: dict, rng: random.Random):
        raise NotImplementedError

    def rng(self, example: dict, position: int) -> random.Random:
        return random.Random(self.seed * SEED_STRIDE + int(example.get("index", position)))

    def row_weights(self, example: dict, rows: PromptRows) -> torch.Tensor | None:
        """Per-row loss weights of one example, aligned with its rows; None means all 1."""
        return None

    def example_rows(self, example: dict, position: int = 0) -> tuple[PromptRows, torch.Tensor | None]:
        rows = self.processor.rows(self.request(example, self.rng(example, position)))
        weights = self.row_weights(example, rows)
        if self.max_rows is not None and len(rows) > self.max_rows:
            cut = slice(0, self.max_rows)
            rows = PromptRows(rows.input_ids[cut], rows.audio_codes[cut], rows.supervised[cut])
            weights = None if weights is None else weights[cut]
        return rows, weights

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        built = [self.example_rows(example, position) for position, example in enumerate(examples)]
        batch = dict(self.processor.pad([rows for rows, _ in built], return_labels=True, padding_side="right"))
        if any(weights is not None for _, weights in built):
            length = batch["input_ids"].shape[1]
            row_weights = torch.zeros(len(built), length)
            for item, (rows, weights) in enumerate(built):
                row_weights[item, : len(rows)] = 1.0 if weights is None else weights
            batch["row_weights"] = row_weights
        return batch


def _history(example: dict) -> tuple[Take, ...]:
    """History turns: `example["history"]` = [{"text", "codes"}, ...], oldest first (context only)."""
    return tuple(Take(lines=turn["text"], audio=as_codes(turn["codes"])) for turn in example.get("history") or ())


class TTSCollator(RowCollator):
    """Plain TTS: no references; the target is the example's audio. Optional `history` turns and an
    `instruction` (multi-turn revision: "softer than the previous take") stay context only."""

    def request(self, example, rng):
        return Script(
            lines=example["text"],
            history=_history(example),
            instruction=example.get("instruction"),
            target=as_codes(example["codes"]),
        )


class CloningCollator(RowCollator):
    """Voice cloning: 1..`max_references` references drawn from OTHER utterances of the example's
    speaker (never the target itself), then the target. An example whose speaker has no other
    utterance is trained as plain TTS. Needs `index` in each example (its row in `pool.dataset`;
    `dataset.map(lambda _, i: {"index": i}, with_indices=True)`).
    """

    def __init__(self, processor, pool: ReferencePool, max_references: int = 1, **kwargs):
        super().__init__(processor, **kwargs)
        self.pool = pool
        self.max_references = max_references

    def request(self, example, rng):
        candidates = self.pool.others(example["speaker"], exclude=int(example["index"]))
        count = min(len(candidates), rng.randint(1, self.max_references))
        references = [self.pool.reference(index) for index in rng.sample(candidates, count)]
        return Script(
            lines=example["text"],
            references=references,
            history=_history(example),
            instruction=example.get("instruction"),
            target=as_codes(example["codes"]),
        )


class DialogueCollator(RowCollator):
    """Multi-speaker dialogue: `example["turns"]` = [{"text", "speaker" (0-15), "codes"}, ...]; all
    lines in one user turn (joined by "\\n", each with its speaker token), the target is the turns'
    audio back to back. `example["references"]` = [{"text", "speaker", "codes"}] binds voices."""

    def request(self, example, rng):
        turns = example["turns"]
        lines = [Line(turn["text"], speaker=int(turn["speaker"])) for turn in turns]
        target = torch.cat([as_codes(turn["codes"]) for turn in turns], dim=1)
        references = [
            Reference(r["text"], as_codes(r["codes"]), speaker=int(r["speaker"])) for r in example.get("references") or ()
        ]
        return Script(lines=lines, references=references, target=target, strict_speakers=bool(references))


class LineByLineCollator(RowCollator):
    """Line-by-line synthesis: `example["turns"]` as for dialogue, but the lines are separated by
    `<|audio_separator|>` in the user turn and the assistant answers one segment per line, segments
    separated by supervised `<|audio_separator|>` tokens (designed from the paper, see the `prompting` package)."""

    def request(self, example, rng):
        turns = example["turns"]
        lines = [Line(turn["text"], speaker=int(turn.get("speaker", 0))) for turn in turns]
        references = [
            Reference(r["text"], as_codes(r["codes"]), speaker=int(r["speaker"])) for r in example.get("references") or ()
        ]
        return LineByLineScript(
            lines=lines,
            references=references,
            target=[as_codes(turn["codes"]) for turn in turns],
            strict_speakers=bool(references),
        )


class StreamingCollator(RowCollator):
    """Streaming text input (designed from the paper): `example["turns"]` = [{"text", "codes"}, ...]
    are the chunks in order with their audio [, "references"]. Turn k's user message holds chunk k,
    `<|interleave|>` and chunk k + 1 as look-ahead; every assistant turn is supervised (they are
    all the model's own output). These are the rows `model.stream_text` extends its cache with."""

    def request(self, example, rng):
        turns = example["turns"]
        references = [
            Reference(r["text"], as_codes(r["codes"]), speaker=int(r["speaker"])) for r in example.get("references") or ()
        ]
        return StreamingScript(
            chunks=[turn["text"] for turn in turns],
            references=references,
            spoken=[as_codes(turn["codes"]) for turn in turns],
            strict_speakers=bool(references),
        )


class InfillCollator(RowCollator):
    """Speech infilling: the example's audio with an edit window regenerated; the rows keep the
    source outside the window (context) and supervise the middle and its `<|im_end|>`.

    The window is `example["window"]` = [first, last) frames, or drawn at random covering
    `min_fraction`..`max_fraction` of the frames. Rows at the seams — the first `seam_frames`
    supervised rows after the prefix and the last `seam_frames` before the suffix, plus the closing
    `<|im_end|>` — get weight `seam_weight` in `row_weights` (the paper up-weights the seams);
    `Drama3Trainer` applies it. The published model's forward has no per-row weights.
    """

    def __init__(
        self,
        processor,
        seam_frames: int = DEFAULT_SEAM_FRAMES,
        seam_weight: float = DEFAULT_SEAM_WEIGHT,
        min_fraction: float = 0.2,
        max_fraction: float = 0.5,
        **kwargs,
    ):
        super().__init__(processor, **kwargs)
        self.seam_frames = seam_frames
        self.seam_weight = seam_weight
        self.min_fraction = min_fraction
        self.max_fraction = max_fraction

    def window(self, example: dict, rng: random.Random) -> tuple[int, int]:
        frames = as_codes(example["codes"]).shape[1]
        if example.get("window") is not None:
            first, last = (int(value) for value in example["window"])
        else:
            size = max(1, round(frames * rng.uniform(self.min_fraction, self.max_fraction)))
            size = min(size, frames - 1)
            first = rng.randint(0, frames - size)
            last = first + size
        if not 0 <= first < last <= frames or last - first == frames:
            raise ValueError(f"window [{first}, {last}) of an example with {frames} frames must be a proper part of it")
        return first, last

    def request(self, example, rng):
        codes = as_codes(example["codes"])
        first, last = self.window(example, rng)
        return Infill(
            lines=example["text"],
            source=codes,
            start=first,
            end=last,
            unit="frames",
            target=codes[:, first:last],
        )

    def row_weights(self, example, rows):
        weights = torch.ones(len(rows))
        supervised = rows.supervised.nonzero().flatten()  # middle frames, then <|im_end|>
        middle = supervised[:-1]
        seams = torch.cat((middle[: self.seam_frames], middle[-self.seam_frames :], supervised[-1:]))
        weights[seams] = self.seam_weight
        return weights
