"""Requests -> model rows: raw text and scripts (`prompting`) become one request each, each request
its rows, and the rows a padded batch with the layout's metadata; and the way back (rows -> the
request, a request -> its text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature

from ..prompting import (
    IGNORE_INDEX,
    Clip,
    Frames,
    Infill,
    LayoutContext,
    PromptRows,
    Reference,
    Request,
    Script,
    StreamingScript,
    as_clip,
    assemble_infill,
    check_codes,
    encode_layout,
    parse_rows,
    parse_text,
    part_text,
    semantic_token,
)


class RowsMixin:
    """The request-to-rows methods of `Drama3Processor`, `__call__` among them.

    Reads the processor's `tokenizer`, `token_ids`, `front_end`, `num_codebooks`, `codebook_size`,
    `frame_rate`, `min_reference_fraction`, `chunk_bytes` and `chunk_speakers`, and its audio-in
    methods (`codes_of`, `check_reference_covers`)."""

    def layout_context(self) -> LayoutContext:
        return LayoutContext(codes_of=self.codes_of, frame_rate=self.frame_rate)

    def references_from(
        self,
        reference_audio: Any = None,
        reference_text: str | Sequence[str] | None = None,
        reference_speaker: int | Sequence[int] | None = None,
        sampling_rate: int | None = None,
    ) -> tuple[Reference, ...]:
        """Parallel lists of reference audio and transcripts (and speakers, 0 by default) -> references."""
        if reference_audio is None and reference_text is None:
            return ()
        audios = list(reference_audio) if isinstance(reference_audio, (list, tuple)) else [reference_audio]
        texts = [reference_text] if isinstance(reference_text, str) else list(reference_text or [])
        if reference_audio is None or len(audios) != len(texts):
            raise ValueError(
                f"reference_audio/reference_text: {0 if reference_audio is None else len(audios)} reference "
                f"audios but {len(texts)} transcripts; every reference needs exactly one transcript"
            )
        if reference_speaker is None:
            speakers = [None] * len(audios)  # a transcript's own leading tag, else speaker 0
        elif isinstance(reference_speaker, (int, np.integer)):
            speakers = [reference_speaker] * len(audios)
        else:
            speakers = list(reference_speaker)
        if len(speakers) != len(audios):
            raise ValueError(f"reference_speaker: {len(speakers)} speakers for {len(audios)} references")
        return tuple(
            Reference(text, as_clip(audio, f"references[{index}].audio", sampling_rate), speaker)
            for index, (audio, text, speaker) in enumerate(zip(audios, texts, speakers))
        )

    def as_request(self, item: Any, references: Sequence[Reference], location: str) -> Request:
        if isinstance(item, (Script, Infill, StreamingScript)):
            if references:
                raise ValueError(f"{location}: give references inside the script, not beside it")
            return item
        if isinstance(item, str):
            parse_text(item, location)  # refused here with its location; the Script keeps it as given
            return Script(lines=item, references=references)
        raise ValueError(f"{location}: expected a str, Script, Infill or StreamingScript; got {type(item).__name__}")

    def rows(self, request: Request) -> PromptRows:
        """One request's rows (no padding)."""
        context = self.layout_context()
        transcripts = {id(reference.audio): reference.transcript for reference in getattr(request, "references", ())}
        if transcripts and self.min_reference_fraction > 0:
            context = LayoutContext(self._reference_checker(transcripts), self.frame_rate)
        return encode_layout(request.layout(context), self.tokenizer, self.token_ids, self.num_codebooks, self.front_end)

    def _reference_checker(self, transcripts: dict[int, str]):
        """`codes_of` that also refuses a reference far too short for its transcript (a 1 ms clip, a
        file cut to a tenth; see `min_reference_fraction`): a voice learnt from audio that is not
        those words. `transcripts`: id of each reference's clip -> its transcript."""

        def codes_of(clip: Clip, location: str, is_reference: bool = False) -> torch.Tensor:
            codes = self.codes_of(clip, location, is_reference)
            if is_reference and id(clip) in transcripts:
                self.check_reference_covers(codes, transcripts[id(clip)], location)
            return codes

        return codes_of

    def __call__(
        self,
        text: str | Request | Sequence[str | Request] | None = None,
        *,
        references: Sequence[Reference] | None = None,
        reference_audio: Any = None,
        reference_text: str | Sequence[str] | None = None,
        reference_speaker: int | Sequence[int] | None = None,
        sampling_rate: int | None = None,
        return_labels: bool | None = None,
        padding_side: str = "left",
        return_tensors: str | None = "pt",
        **kwargs,
    ) -> BatchFeature:
        """Rows for one request or a batch.

        Args:
            text: raw text (speaker tags `<|speaker:N|>` allowed), a `Script` / `LineByLineScript` /
                `Infill` / `StreamingScript`, or a list of them (a batch).
            references / reference_audio + reference_text (+ reference_speaker): voice references
                for raw-text items (scripts carry their own).
            sampling_rate: rate of waveforms given in reference_audio (the codec's when None).
            return_labels: force labels on or off (default: on when a request has target audio).
            padding_side: "left" (generation, default) or "right".
        """
        if kwargs:
            raise TypeError(f"Drama3Processor got unexpected arguments {sorted(kwargs)}")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors: only 'pt' is supported; got {return_tensors!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side: 'left' or 'right'; got {padding_side!r}")
        if text is None:
            raise ValueError("text: nothing to speak")
        items = list(text) if isinstance(text, (list, tuple)) else [text]
        if not items:
            raise ValueError("text: the batch is empty")
        if references is not None and (reference_audio is not None or reference_text is not None):
            raise ValueError("give references or reference_audio/reference_text, not both")
        if references is None:
            references = self.references_from(reference_audio, reference_text, reference_speaker, sampling_rate)
        references = tuple(references)
        location = (lambda index: f"text[{index}]") if len(items) > 1 else (lambda index: "text")
        requests = [self.as_request(item, references, location(index)) for index, item in enumerate(items)]
        rows = [self.rows(request) for request in requests]
        if return_labels is None:
            return_labels = any(bool(r.supervised.any()) for r in rows)
        batch = self.pad(rows, return_labels=return_labels, padding_side=padding_side)
        batch.update(self.layout_metadata(rows, batch["input_ids"].shape[1], padding_side))
        return batch

    def layout_metadata(self, rows: Sequence[PromptRows], length: int, padding_side: str = "left") -> dict:
        """What the layout says about each prompt, in padded row coordinates, for `generate()`:

        - `speak_span` [batch, 2] long: [start, stop) rows of the text of the turn to speak (its
          length sets the frame budget);
        - `boundaries_left` [batch] long: line boundaries (`<|audio_separator|>`) still to draw.
        """
        spans = torch.zeros(len(rows), 2, dtype=torch.long)
        for index, row in enumerate(rows):
            offset = length - len(row) if padding_side == "left" else 0
            spans[index] = torch.tensor(row.speak_span) + offset
        boundaries = torch.tensor([row.boundaries_left for row in rows], dtype=torch.long)
        return {"speak_span": spans, "boundaries_left": boundaries}

    def pad(self, rows: Sequence[PromptRows], return_labels: bool = False, padding_side: str = "left") -> BatchFeature:
        """Stack prompts into a batch: pad id / zero codes / mask 0 / label -100 on the padding."""
        length = max(len(r) for r in rows)
        batch = len(rows)
        input_ids = torch.full((batch, length), self.token_ids.pad, dtype=torch.long)
        audio_codes = torch.zeros(batch, length, self.num_codebooks, dtype=torch.long)
        attention_mask = torch.zeros(batch, length, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        for index, row in enumerate(rows):
            span = slice(length - len(row), length) if padding_side == "left" else slice(0, len(row))
            input_ids[index, span] = row.input_ids
            audio_codes[index, span] = row.audio_codes
            attention_mask[index, span] = 1
            labels[index, span] = row.labels
        data = {"input_ids": input_ids, "audio_codes": audio_codes, "attention_mask": attention_mask}
        if return_labels:
            data["labels"] = labels
        return BatchFeature(data=data, tensor_type="pt")

    def chunk(self, script: Script) -> list[Script]:
        """Long text -> one script per chunk (spec §4 limits of this processor)."""
        return script.chunks(self.chunk_bytes, self.chunk_speakers)

    def infill_codes(self, infill: Infill, middle: torch.Tensor) -> torch.Tensor:
        """The whole edited recording as codes [num_codebooks, frames]: prefix + middle + suffix.

        `middle` is the generated middle, [num_codebooks, frames] or [frames, num_codebooks]."""
        if middle.ndim == 2 and middle.shape[0] != self.num_codebooks and middle.shape[1] == self.num_codebooks:
            middle = middle.T
        middle = check_codes(middle, self.num_codebooks, self.codebook_size, "middle")
        prefix, suffix = infill.kept_codes(self.layout_context())
        return assemble_infill(prefix, middle, suffix)

    def parse(self, batch: BatchFeature | dict, index: int = 0) -> Request:
        """Rows of one batch item -> the request they encode, whatever its layout (padding removed;
        see `prompting.parse_rows`). The batch's labels, when it has them, tell an infilling
        target's frames from the kept prefix."""
        mask = batch["attention_mask"][index].bool()
        labels = batch.get("labels")
        supervised = None if labels is None else labels[index][mask] != IGNORE_INDEX
        return parse_rows(
            batch["input_ids"][index][mask], batch["audio_codes"][index][mask], self.tokenizer, self.token_ids, supervised
        )

    def render(self, request: Request) -> str:
        """The prompt as text, audio frames written as their `<|semantic:c0|>` tokens (for reading)."""
        out = []
        for segment in request.layout(self.layout_context()):
            if isinstance(segment, Frames):
                out.extend(semantic_token(int(code)) for code in segment.codes[0])
            else:
                out.extend(part_text(part) for part in segment.parts)
        return "".join(out)
