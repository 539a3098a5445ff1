"""Golden token ids: every layout against a hand-written expected layout.

Expected rows are built the way the public implementations build them: each literal string is
tokenized on its own by the tokenizer (special tokens recognised), audio frames become
`<|semantic:c0|>` rows, ids are concatenated. Published layouts come from spec §4; the designed
ones from docs/prompt_layouts.md."""

import torch

from processor_helpers import expected_rows, only_item, random_codes, tiny_processor, tiny_tokenizer, token_id
from transformers_drama3.prompting import (
    Infill,
    Line,
    LineByLineScript,
    Reference,
    Script,
    Literal,
    Special,
    StreamingScript,
    Take,
    encode_layout,
    encode_text,
)

PLAIN = "convert the provided text to speech"
WITH_REFERENCES = "convert the provided text to speech reference to the following:"


def assert_rows(batch, segments):
    input_ids, audio_codes = only_item(batch)
    expected_ids, expected_codes = expected_rows(segments)
    assert input_ids.tolist() == expected_ids.tolist()
    assert torch.equal(audio_codes, expected_codes)


def test_no_reference():
    processor = tiny_processor()
    assert_rows(
        processor("Hello there."),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> Hello there.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_one_reference():
    processor = tiny_processor()
    ref = random_codes(4, seed=1)
    assert_rows(
        processor("Target text.", reference_audio=ref, reference_text="Reference words."),
        [
            "<|im_start|>system\n", WITH_REFERENCES,
            "\n\n[Reference 1]\nText: <|speaker:0|> Reference words.\nSpeech: ", ref,
            "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> Target text.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_several_references_of_several_speakers():
    processor = tiny_processor()
    a, b, c = random_codes(3, seed=1), random_codes(5, seed=2), random_codes(2, seed=3)
    script = Script(
        "<|speaker:0|>Where were you?<|speaker:1|>Out.",
        references=[Reference("First voice.", a, 0), Reference("Second voice.", b, 1), Reference("Again one.", c, 0)],
    )
    assert_rows(
        processor(script),
        [
            "<|im_start|>system\n", WITH_REFERENCES,
            "\n\n[Reference 1]\nText: <|speaker:0|> First voice.\nSpeech: ", a,
            "\n\n[Reference 2]\nText: <|speaker:1|> Second voice.\nSpeech: ", b,
            "\n\n[Reference 3]\nText: <|speaker:0|> Again one.\nSpeech: ", c,
            "<|im_end|>\n",
            # raw text is the user turn as given (no space or line break added at the tags)
            "<|im_start|>user\n", "<|speaker:0|>Where were you?<|speaker:1|>Out.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_history_turns_and_a_relative_instruction():
    processor = tiny_processor()
    ref, take = random_codes(3, seed=1), random_codes(6, seed=2)
    script = Script(
        "I told you so.",
        references=[Reference("Voice.", ref)],
        history=[Take("I told you so.", take)],
        instruction="softer than the previous take",
    )
    assert_rows(
        processor(script),
        [
            "<|im_start|>system\n", WITH_REFERENCES,
            "\n\n[Reference 1]\nText: <|speaker:0|> Voice.\nSpeech: ", ref, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> I told you so.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", take, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> [softer than the previous take] I told you so.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_tags_styles_and_notes_are_plain_text_in_the_line():
    processor = tiny_processor()
    line = Line("<whisper>Quiet</whisper> [laughs] now.", 2, style="fast", note="amused", language="english")
    assert_rows(
        processor(Script([line])),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n",
            "<|speaker:2|> (fast) [amused] <english><whisper>Quiet</whisper> [laughs] now.</english>",
            "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_a_training_target_ends_the_turn():
    processor = tiny_processor()
    target = random_codes(5, seed=4)
    assert_rows(
        processor(Script("Say it.", target=target)),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> Say it.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", target, "<|im_end|>\n",
        ],
    )


def test_literals_are_tokenized_on_their_own():
    """Two literals are never joined before tokenizing: at a seam where white space meets a word,
    joining would merge them into one token and change the ids."""
    tokenizer = tiny_tokenizer()
    processor = tiny_processor()
    rows = encode_layout([Literal(("a ",)), Literal(("b",))], tokenizer, processor.token_ids, 10)
    separate = encode_text(tokenizer, "a ") + encode_text(tokenizer, "b")
    assert rows.input_ids.tolist() == separate
    assert separate != encode_text(tokenizer, "a b")


def test_text_and_special_parts_of_one_literal_join_as_the_public_code_does():
    """Inside one literal, text runs between special tokens are tokenized as they would be in the
    joined string (special tokens always split a string)."""
    tokenizer = tiny_tokenizer()
    processor = tiny_processor()
    literal = Literal(("Text: ", Special("<|speaker:3|>"), " hi", "\nSpeech: "))
    rows = encode_layout([literal], tokenizer, processor.token_ids, 10)
    assert rows.input_ids.tolist() == expected_rows(["Text: <|speaker:3|> hi\nSpeech: "])[0].tolist()


# ---- layouts designed from the paper -------------------------------------------------------------------


def test_line_by_line_scene_with_every_segment():
    processor = tiny_processor()
    a, b, c = random_codes(3, seed=1), random_codes(2, seed=2), random_codes(4, seed=3)
    script = LineByLineScript(
        [Line("First.", 0), Line("Second.", 1), Line("Third.", 0)], target=[a, b, c]
    )
    assert_rows(
        processor(script),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n",
            "<|speaker:0|> First.<|audio_separator|><|speaker:1|> Second.<|audio_separator|><|speaker:0|> Third.",
            "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", a, "<|audio_separator|>", b, "<|audio_separator|>", c, "<|im_end|>\n",
        ],
    )


def test_line_by_line_continuation_ends_after_the_last_separator():
    processor = tiny_processor()
    a = random_codes(3, seed=1)
    assert_rows(
        processor(LineByLineScript(["One.", "Two."], target=[a])),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> One.<|audio_separator|><|speaker:0|> Two.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", a, "<|audio_separator|>",
        ],
    )


def test_line_by_line_prompt_without_segments():
    processor = tiny_processor()
    assert_rows(
        processor(LineByLineScript(["One.", "Two."])),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> One.<|audio_separator|><|speaker:0|> Two.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_infill_by_frames_keeps_suffix_then_prefix():
    processor = tiny_processor()
    source = random_codes(10, seed=5)
    infill = Infill("The new full sentence.", source=source, start=3, end=6, unit="frames")
    assert_rows(
        processor(infill),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> The new full sentence.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", source[:, 6:], "<|audio_separator|>", source[:, :3],
        ],
    )


def test_infill_by_seconds_equals_infill_by_frames():
    processor = tiny_processor()
    source = random_codes(60, seed=5)
    rate = processor.frame_rate  # 21.53 frames/s
    by_seconds = processor(Infill("x", source=source, start=10 / rate + 0.01, end=20 / rate - 0.01))
    by_frames = processor(Infill("x", source=source, start=10, end=20, unit="frames"))
    assert torch.equal(by_seconds["input_ids"], by_frames["input_ids"])


def test_infill_by_prefix_and_suffix_audio_and_target():
    processor = tiny_processor()
    prefix, suffix, middle = random_codes(2, seed=1), random_codes(3, seed=2), random_codes(4, seed=3)
    infill = Infill("Edited.", prefix=prefix, suffix=suffix, target=middle)
    assert_rows(
        processor(infill),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> Edited.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", suffix, "<|audio_separator|>", prefix, middle, "<|im_end|>\n",
        ],
    )
    assert torch.equal(processor.infill_codes(infill, middle), torch.cat([prefix, middle, suffix], dim=1))


def test_infill_at_the_start_has_no_prefix():
    processor = tiny_processor()
    suffix = random_codes(3, seed=2)
    assert_rows(
        processor(Infill("New start.", suffix=suffix)),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> New start.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", suffix, "<|audio_separator|>",
        ],
    )


def test_streaming_turns_carry_one_look_ahead_chunk():
    processor = tiny_processor()
    first, second = random_codes(3, seed=1), random_codes(2, seed=2)
    streaming = StreamingScript(["One.", "<|speaker:1|>Two.", "Three."], spoken=[first, second])
    assert_rows(
        processor(streaming),
        [
            "<|im_start|>system\n", PLAIN, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> One.<|interleave|><|speaker:1|> Two.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", first, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:1|> Two.<|interleave|><|speaker:0|> Three.", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>", second, "<|im_end|>\n",
            "<|im_start|>user\n", "<|speaker:0|> Three.<|interleave|>", "<|im_end|>\n",
            "<|im_start|>assistant\n<|voice|>",
        ],
    )


def test_audio_rows_carry_the_semantic_token_of_codebook_zero():
    processor = tiny_processor()
    target = random_codes(4, seed=9)
    input_ids, audio_codes = only_item(processor(Script("x", target=target)))
    start = token_id("<|semantic:0|>")
    audio = (input_ids >= start) & (input_ids < start + 4096)
    assert torch.equal(input_ids[audio] - start, audio_codes[audio, 0])
    assert not audio_codes[~audio].any()
    assert audio.sum() == 4
