"""Drama3Processor without a codec: rows parse back to the request that made them (`processor.parse`)."""

import pytest
import torch

from processor_helpers import random_codes, tiny_processor, token_id
from transformers_drama3.prompting import (
    Infill,
    Line,
    LineByLineScript,
    Reference,
    Script,
    StreamingScript,
    Take,
)


# ---- round trips --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script",
    [
        Script("Hello."),
        Script(
            "<|speaker:0|>Where were you?<|speaker:1|>[sighs] Out. <whisper>Sorry.</whisper>",
            references=[Reference("First.", random_codes(3, 1), 0), Reference("Second.", random_codes(2, 2), 1)],
            history=[Take("<|speaker:1|>Out.", random_codes(4, 3))],
            target=random_codes(5, 4),
        ),
        LineByLineScript([Line("One.", 0), Line("Two.", 1)], target=[random_codes(2, 5), random_codes(3, 6)]),
        LineByLineScript(["One.", "Two.", "Three."], target=[random_codes(2, 5)]),
    ],
)
def test_script_to_rows_to_script_to_the_same_rows(script):
    processor = tiny_processor()
    batch = processor(script)
    parsed = processor.parse(batch)
    assert type(parsed) is type(script)
    assert parsed.lines == script.lines
    assert [r.transcript for r in parsed.references] == [r.transcript for r in script.references]
    assert [r.speaker for r in parsed.references] == [r.speaker for r in script.references]
    again = processor(parsed)
    assert torch.equal(again["input_ids"], batch["input_ids"])
    assert torch.equal(again["audio_codes"], batch["audio_codes"])


def test_parsing_reads_the_reference_and_target_codes_back():
    processor = tiny_processor()
    ref, target = random_codes(3, seed=1), random_codes(4, seed=2)
    parsed = processor.parse(processor(Script("Hi.", references=[Reference("r", ref)], target=target)))
    assert torch.equal(parsed.references[0].audio.codes, ref)
    assert torch.equal(parsed.target.codes, target)


# ---- every designed layout parses back -----------------------------------------------------------------


def described(processor, request):
    """A request as plain data, audio as codes lists: equal data means the same request. Lines are
    (speaker, rendered text): a style or note comes back as the text it was written as (a line that
    starts with "[sighs]" and one with note="sighs" are the same rows)."""
    context = processor.layout_context()

    def lines(items):
        return [(line.speaker, line.body()) for line in items]

    def codes(clip):
        return processor.codes_of(clip, "clip").tolist()

    data = {
        "type": type(request).__name__,
        "references": [(r.transcript, r.speaker, codes(r.audio)) for r in request.references],
    }
    if isinstance(request, StreamingScript):
        # rows reach the look-ahead of the open turn: chunk len(spoken) + 1 is the last in them
        data["chunks"] = [lines(chunk) for chunk in request.chunks[: len(request.spoken) + 2]]
        data["spoken"] = [codes(clip) for clip in request.spoken]
        return data
    data["lines"] = lines(request.lines)
    if isinstance(request, Infill):
        prefix, suffix = request.kept_codes(context)
        data.update(prefix=prefix.tolist(), suffix=suffix.tolist())
        data["target"] = None if request.target is None else codes(request.target)
        return data
    data["history"] = [(lines(take.lines), codes(take.audio)) for take in request.history]
    if isinstance(request, LineByLineScript):
        data["target"] = [codes(clip) for clip in request.target or ()]
    else:
        data["target"] = None if request.target is None else codes(request.target)
    return data


TWO_VOICES = [Reference("First.", random_codes(3, 1), 0), Reference("Second.", random_codes(2, 2), 1)]
SCENE = [Line("Where were you?", 0), Line("[sighs] Out.", 1, style="tired"), Line("Out where?", 0, note="sharp")]


@pytest.mark.parametrize(
    "request_",
    [
        LineByLineScript(SCENE, references=TWO_VOICES, target=[random_codes(2, 5), random_codes(3, 6), random_codes(1, 7)]),
        LineByLineScript(SCENE, references=TWO_VOICES, target=[random_codes(2, 5)]),
        LineByLineScript(SCENE, references=TWO_VOICES, history=[Take("<|speaker:1|>Before.", random_codes(2, 8))]),
        LineByLineScript([Line(f"Line {n}.", n % 4) for n in range(5)]),
        Infill("Edited words.", prefix=random_codes(3, 1), suffix=random_codes(2, 2)),
        Infill("Edited words.", prefix=random_codes(3, 1), suffix=random_codes(2, 2), target=random_codes(4, 3)),
        Infill("Edited.", source=random_codes(12, 4), start=3, end=7, unit="frames", target=random_codes(5, 5)),
        Infill("Edited.", source=random_codes(12, 4), start=0, end=7, unit="frames", target=random_codes(2, 6)),
        Infill("Edited.", source=random_codes(12, 4), start=9, unit="frames", references=TWO_VOICES[:1]),
        StreamingScript(["One.", "Two.", "<|speaker:1|>Three."], references=TWO_VOICES),
        StreamingScript(["One.", "Two.", "Three."], spoken=[random_codes(2, 1)]),
        StreamingScript(["One.", "Two.", "Three."], spoken=[random_codes(2, 1), random_codes(3, 2)]),
        StreamingScript(["One.", "Two."], spoken=[random_codes(2, 1), random_codes(3, 2)]),
    ],
)
def test_every_designed_layout_parses_back_to_its_request(request_):
    processor = tiny_processor()
    batch = processor(request_)
    parsed = processor.parse(batch)
    assert described(processor, parsed) == described(processor, request_)
    again = processor(parsed)
    for key in ("input_ids", "audio_codes", "attention_mask"):
        assert torch.equal(again[key], batch[key])
    assert ("labels" in again) == ("labels" in batch)
    if "labels" in batch:
        assert torch.equal(again["labels"], batch["labels"])


def test_a_padded_batch_of_mixed_layouts_parses_item_by_item():
    processor = tiny_processor()
    requests = [
        Script("Plain."),
        Infill("Edited.", prefix=random_codes(2, 1), target=random_codes(3, 2)),
        StreamingScript(["A.", "B."], spoken=[random_codes(2, 3)]),
    ]
    batch = processor(requests)
    for index, request in enumerate(requests):
        assert described(processor, processor.parse(batch, index)) == described(processor, request)


def test_infill_training_rows_without_labels_cannot_be_split():
    processor = tiny_processor()
    batch = processor(Infill("Edited.", prefix=random_codes(2, 1), target=random_codes(3, 2)))
    del batch["labels"]
    with pytest.raises(ValueError, match="give their labels"):
        processor.parse(batch)


def test_streaming_rows_whose_chunk_is_not_the_look_ahead_are_refused():
    processor = tiny_processor()
    first = processor(StreamingScript(["One.", "Two."], spoken=[random_codes(2, 1)]))
    other = processor(StreamingScript(["One.", "Other."], spoken=[random_codes(2, 1)]))
    # the second turn of `other` after the first turn of `first` (whose look-ahead is "Two.")
    ids_a, ids_b = first["input_ids"][0], other["input_ids"][0]
    voice_end = (ids_a == token_id("<|im_end|>")).nonzero().flatten()[2].item() + 2  # after the first take
    cut_b = (ids_b == token_id("<|im_end|>")).nonzero().flatten()[2].item() + 2
    input_ids = torch.cat([ids_a[:voice_end], ids_b[cut_b:]])
    audio_codes = torch.cat([first["audio_codes"][0][:voice_end], other["audio_codes"][0][cut_b:]])
    spliced = {"input_ids": input_ids[None], "audio_codes": audio_codes[None], "attention_mask": torch.ones(1, len(input_ids))}
    with pytest.raises(ValueError, match="not the previous turn's look-ahead"):
        processor.parse(spliced)
