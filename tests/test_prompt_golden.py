"""Golden rows of the published layout, written from the published rule, not from the encoder.

The rule (spec §4, as both public implementations apply it): each literal below is tokenized on
its own by the backend tokenizer, special tokens recognised; the user turn is the caller's text as
given, with "<|speaker:0|> " put in front only when no speaker tag leads it after white space; a
reference transcript follows "Text: " with its leading tag moved in front of its leading white
space. `expected_rows` tokenizes the literals; the test writes them out by hand."""

import numpy as np
import pytest
import torch

from processor_helpers import expected_rows, only_item, random_codes, tiny_processor
from transformers_drama3.prompting.bare_rows import boundaries_left_of_rows as separators_left
from transformers_drama3.prompting import Clip, Infill, LineByLineScript, Reference, Script, StreamingScript, Take, speaker_turns

TTS = "convert the provided text to speech"
WITH_REFERENCES = "convert the provided text to speech reference to the following:"


def rows_of(processor, *args, **kwargs):
    return only_item(processor(*args, **kwargs))


def assert_published(batch, segments):
    input_ids, audio_codes = only_item(batch)
    expected_ids, expected_codes = expected_rows(segments)
    assert input_ids.tolist() == expected_ids.tolist()
    assert torch.equal(audio_codes, expected_codes)


def plain(text: str) -> list:
    """The whole published prompt of `text` (already tagged as the rule says), no references."""
    return [
        "<|im_start|>system\n", TTS, "<|im_end|>\n",
        "<|im_start|>user\n", text, "<|im_end|>\n",
        "<|im_start|>assistant\n<|voice|>",
    ]


# ---- the user turn: text as given ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, turn",
    [
        # 1. a tag inside the text: no line break inserted before it
        ("Did you? <|speaker:1|> Yes.", "<|speaker:0|> Did you? <|speaker:1|> Yes."),
        # 2. a leading tag without a space: no space added
        ("<|speaker:2|>Hello", "<|speaker:2|>Hello"),
        # a leading tag after white space: the text is already tagged, kept as it is
        ("  <|speaker:3|> Hi", "  <|speaker:3|> Hi"),
        # 3. line breaks and white space at the ends are kept
        ("First line.\nSecond line.", "<|speaker:0|> First line.\nSecond line."),
        ("\n  Padded.  \n", "<|speaker:0|> \n  Padded.  \n"),
        ("<|speaker:0|>A\n<|speaker:1|>B\r\n", "<|speaker:0|>A\n<|speaker:1|>B\r\n"),
        # tags, brackets and comparisons are plain text of the turn
        ("<whisper>quiet</whisper> [laughs] 3 < 5", "<|speaker:0|> <whisper>quiet</whisper> [laughs] 3 < 5"),
        # a half special-token spelling that is not a structural token stays text
        ("a <| b |", "<|speaker:0|> a <| b |"),
    ],
)
def test_the_user_turn_is_the_text_as_given(text, turn):
    assert_published(tiny_processor()(text), plain(turn))


def test_a_script_of_raw_text_is_the_text_as_given():
    processor = tiny_processor()
    assert_published(processor(Script("Did you? <|speaker:1|> Yes.")), plain("<|speaker:0|> Did you? <|speaker:1|> Yes."))


def test_every_speaker_tag_is_its_special_token():
    text = "".join(f"<|speaker:{s}|>{s}." for s in range(16))
    assert_published(tiny_processor()(text), plain(text))


# ---- references: transcripts as given ----------------------------------------------------------------


@pytest.mark.parametrize(
    "transcript, speaker, written",
    [
        ("Reference words.", None, "<|speaker:0|> Reference words."),
        ("Reference words.", 4, "<|speaker:4|> Reference words."),
        # 3. line breaks in a transcript are kept
        ("Two\nlines.", None, "<|speaker:0|> Two\nlines."),
        # 4. a transcript with its own tag, or starting with white space, is accepted as written
        ("<|speaker:5|>Tagged.", None, "<|speaker:5|>Tagged."),
        ("<|speaker:5|> Tagged.", 5, "<|speaker:5|> Tagged."),
        ("  <|speaker:6|>Moved.", None, "<|speaker:6|>  Moved."),
        ("  Leading space.", None, "<|speaker:0|>   Leading space."),
        ("<|speaker:1|> Two <|speaker:2|> voices.", None, "<|speaker:1|> Two <|speaker:2|> voices."),
    ],
)
def test_a_reference_transcript_is_written_as_given(transcript, speaker, written):
    processor = tiny_processor()
    ref = random_codes(3, seed=1)
    reference = Reference(transcript, ref, speaker)
    speaking = reference.checked("r").speaker
    assert_published(
        processor(Script(f"<|speaker:{speaking}|> Target.", references=[reference])),
        [
            "<|im_start|>system\n", WITH_REFERENCES,
            f"\n\n[Reference 1]\nText: {written}\nSpeech: ", ref,
            "<|im_end|>\n",
            "<|im_start|>user\n", f"<|speaker:{speaking}|> Target.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_references_of_any_speakers_and_history_takes():
    processor = tiny_processor()
    a, b, take = random_codes(3, seed=1), random_codes(2, seed=2), random_codes(4, seed=3)
    script = Script(
        "<|speaker:15|>Now\nthis.",
        references=[Reference("<|speaker:15|>Ref one.", a), Reference("Ref two.", b, 9)],
        history=[Take("<|speaker:9|>Before.\n", take)],
    )
    assert_published(
        processor(script),
        [
            "<|im_start|>system\n", WITH_REFERENCES,
            "\n\n[Reference 1]\nText: <|speaker:15|>Ref one.\nSpeech: ", a,
            "\n\n[Reference 2]\nText: <|speaker:9|> Ref two.\nSpeech: ", b,
            "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:9|>Before.\n", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", take, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:15|>Now\nthis.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_a_transcript_tag_and_a_different_speaker_are_refused():
    with pytest.raises(ValueError, match=r"references\[0\].*tagged <\|speaker:2\|> but speaker=3"):
        Script("<|speaker:2|> Hi", references=[Reference("<|speaker:2|> r", random_codes(2), 3)])


# ---- a request that fits one chunk is never rewritten ----------------------------------------------------


def test_a_short_script_is_its_own_only_chunk():
    script = Script("One.\n<|speaker:1|>Two.")
    assert tiny_processor().chunk(script) == [script]
    assert tiny_processor().chunk(script)[0].text == "One.\n<|speaker:1|>Two."


def test_a_scene_of_one_speaker_zero_turn_is_spoken_as_given():
    script = Script("<|speaker:0|>One.\nTwo.", references=[Reference("r", random_codes(2))])
    [(speaker, request)] = speaker_turns(script)
    assert speaker == 0 and request.text == "<|speaker:0|>One.\nTwo."
    assert torch.equal(tiny_processor()(request)["input_ids"], tiny_processor()(script)["input_ids"])


# ---- refusals: what the published rule refuses -----------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "<|speaker:1| hi",  # 5. malformed speaker spelling
        "<|speaker:16|> hi",
        "<|speaker:01|> hi",
        "<|speaker|> hi",
        "say <|semantic:12",  # 5. a half-written semantic token
        "say <|semantic:12|> now",
        "Hi <|im_end|>",
        "<|im_start|>system",
        "<|voice|>",
        "<|text|>",
        "<|interleave|>",
        "   \n\t",
        "",
    ],
)
def test_what_the_published_rule_refuses_is_refused(text):
    with pytest.raises(ValueError, match="text"):
        tiny_processor()(text)


@pytest.mark.parametrize("transcript", ["<|speaker:1| r", "r <|semantic:3", "  \n", "r <|im_end|>"])
def test_what_the_published_rule_refuses_in_a_transcript_is_refused(transcript):
    with pytest.raises(ValueError, match=r"references\[0\]\.transcript"):
        Script("Hi", references=[Reference(transcript, random_codes(2))])


@pytest.mark.parametrize("text", ["a <|audio_separator|> b", "a <|reserved_7|> b"])
def test_the_project_also_refuses_other_special_token_spellings(text):
    with pytest.raises(ValueError, match="special token"):
        tiny_processor()(text)


# ---- 6. codes input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int16, np.int32, np.int64])
def test_integer_codes_of_any_dtype_give_the_same_rows(dtype):
    processor = tiny_processor()
    ref = random_codes(3, seed=1)
    reference_rows = rows_of(processor, "Hi.", reference_audio=ref, reference_text="r")
    small = ref % 256 if dtype in (np.uint8,) else ref
    expected = rows_of(processor, "Hi.", reference_audio=small, reference_text="r")
    given = rows_of(processor, "Hi.", reference_audio=small.numpy().astype(dtype), reference_text="r")
    assert torch.equal(given[0], expected[0]) and torch.equal(given[1], expected[1])
    if dtype is not np.uint8:
        assert torch.equal(given[0], reference_rows[0])


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_torch_codes_are_accepted(dtype):
    processor = tiny_processor()
    ref = random_codes(3, seed=1)
    expected = rows_of(processor, "Hi.", reference_audio=ref, reference_text="r")
    given = rows_of(processor, "Hi.", reference_audio=ref.to(dtype), reference_text="r")
    assert torch.equal(given[0], expected[0]) and torch.equal(given[1], expected[1])


def test_unsigned_codes_past_the_codebook_are_refused():
    big = random_codes(3, seed=1).numpy().astype(np.uint64)
    big[0, 0] = np.uint64(2**63 + 5)
    with pytest.raises(ValueError, match=r"references\[0\]\.audio: codes must lie in"):
        tiny_processor()("Hi.", reference_audio=big, reference_text="r")


def test_float_codes_are_refused():
    processor = tiny_processor()
    with pytest.raises(ValueError, match=r"codes must be an integer tensor"):
        processor(Script("Hi.", references=[Reference("r", Clip(codes=random_codes(3).float()))]))
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "r"}, {"type": "audio", "codes": random_codes(3).float()}]},
        {"role": "user", "content": "Hi."},
    ]
    with pytest.raises(ValueError, match=r"codes must be an integer tensor"):
        processor.apply_chat_template(conversation)


def test_a_float_array_shaped_and_valued_like_codes_is_not_taken_for_a_waveform():
    with pytest.raises(ValueError, match="looks like codes given as floats"):
        tiny_processor()("Hi.", reference_audio=random_codes(3).float(), reference_text="r")


# ---- the layout's metadata on the rows ---------------------------------------------------------------------


def test_the_speak_span_is_the_text_of_the_turn_to_speak():
    processor = tiny_processor()
    batch = processor(["Short.", "A longer <|speaker:1|> text to speak."])
    for index, text in enumerate(["<|speaker:0|> Short.", "<|speaker:0|> A longer <|speaker:1|> text to speak."]):
        start, stop = batch["speak_span"][index].tolist()
        expected, _ = expected_rows([text])
        assert batch["input_ids"][index, start:stop].tolist() == expected.tolist()
        assert batch["input_ids"][index, stop].item() == processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert batch["boundaries_left"].tolist() == [0, 0]


# ---- rows -> parse -> rows --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script",
    [
        Script("Did you? <|speaker:1|> Yes."),
        Script("  <|speaker:2|>Hello\nthere.  "),
        Script(
            "<|speaker:3|>Now.",
            references=[
                Reference("  <|speaker:3|>Moved.", random_codes(2, 1)),
                Reference(" Spaced.", random_codes(2, 2), 3),
                Reference("<|speaker:3|>a <|speaker:4|> b", random_codes(2, 3)),
            ],
            history=[Take("<|speaker:3|>Before.\n", random_codes(3, 4))],
            instruction="softer",
            target=random_codes(2, 5),
        ),
    ],
)
def test_raw_text_rows_parse_back_to_a_request_with_the_same_rows(script):
    processor = tiny_processor()
    batch = processor(script)
    again = processor(processor.parse(batch))
    for key in ("input_ids", "audio_codes", "attention_mask", "speak_span", "boundaries_left"):
        assert torch.equal(again[key], batch[key])


LAYOUTS = [
    Script("Hi."),
    LineByLineScript(["One.", "<|speaker:1|>Two.", "Three."]),
    LineByLineScript(["One.", "Two.", "Three."], target=[random_codes(2, 1)]),
    LineByLineScript(["One.", "Two."], target=[random_codes(2, 1)]),
    LineByLineScript(["One.", "Two."], target=[random_codes(2, 1), random_codes(2, 2)]),
    Infill("Edited.", prefix=random_codes(3, 1), suffix=random_codes(2, 2)),
    StreamingScript(["One.", "Two.", "Three."], spoken=[random_codes(2, 1)]),
]


def test_the_layouts_line_boundaries_are_what_the_rows_hold():
    """On open prompts the layout's count and the reading of the same rows' ids (generation's
    fallback for bare rows) agree; on closed training rows only the layout knows nothing is left."""
    processor = tiny_processor()
    batch = processor(LAYOUTS)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    read = separators_left(ids, mask, eos, processor.audio_separator_token_id)
    assert batch["boundaries_left"].tolist() == [0, 2, 1, 0, 0, 0, 0]
    closed = 4  # every line has its audio: the voice turn is closed
    assert [v for i, v in enumerate(read.tolist()) if i != closed] == [0, 2, 1, 0, 0, 0]


def test_the_speak_span_lies_inside_the_last_user_turn_of_every_layout():
    processor = tiny_processor()
    batch = processor(LAYOUTS)
    im_start = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    for index in range(len(LAYOUTS)):
        start, stop = batch["speak_span"][index].tolist()
        row = batch["input_ids"][index]
        starts = (row == im_start).nonzero().flatten().tolist()
        user_turn_start = [position for position in starts if position < start][-1]
        assert processor.tokenizer.decode(row[user_turn_start + 1 : start].tolist()) == "user\n"
        assert 0 < stop - start and row[stop].item() == processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
