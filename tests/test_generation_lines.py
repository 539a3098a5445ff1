"""Line-by-line generation: <|audio_separator|> is a main token a line-by-line prompt may draw
between lines; it makes no frame, goes back in as a text row, and is reported as a line boundary."""

import pytest
import torch

from codec_helpers import tiny_codec
from generation_helpers import (
    CODEBOOK_SIZE, EOS, NUM_CODEBOOKS, SEMANTIC_START, SEPARATOR, left_pad, line_model, line_prompt, prompt,
    reference_greedy_lines, script_main_tokens, tiny_model,
)
from transformers import GenerationConfig
from transformers_drama3.prompting.bare_rows import boundaries_left_of_rows as separators_left
from transformers_drama3.generation_drama3 import split_lines

S = SEMANTIC_START


def generate(model, ids, codes, **kwargs):
    kwargs.setdefault("audio_separator_token_id", SEPARATOR)
    return model.generate(ids[None], codes[None], return_dict_in_generate=True, **kwargs)


# ---- which prompts may draw it ------------------------------------------------------------------


def test_separators_left_counts_the_unspoken_line_boundaries():
    prompts = [line_prompt(1, lines=3), line_prompt(2, lines=3, spoken=1), line_prompt(3, lines=2, spoken=1), prompt(4)]
    ids, _, mask = left_pad(prompts)
    assert separators_left(ids, mask, EOS, SEPARATOR).tolist() == [2, 1, 0, 0]


def test_an_infilling_prompt_has_no_line_boundaries():
    ids, _ = prompt(5)  # ... <|im_end|> <|im_start|> text <|im_end|> <|im_start|>
    infill = torch.cat([ids, torch.tensor([S + 1, SEPARATOR, S + 2])])  # suffix <|audio_separator|> prefix
    assert separators_left(infill[None], torch.ones(1, infill.shape[0]), EOS, SEPARATOR).tolist() == [0]


# ---- planted scripts: frames, boundaries, clicks ------------------------------------------------------------------


def test_a_drawn_separator_makes_no_frame_and_is_reported_as_a_line_boundary():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, S + 6, SEPARATOR, S + 7, SEPARATOR, S + 8, S + 9]])
    out = generate(model, *line_prompt(1), do_sample=False, max_new_tokens=20)
    assert out.audio_codes[0, :, 0].tolist() == [5, 6, 7, 8, 9]
    assert out.line_boundaries == [[2, 3]] and out.finish_reasons == ["eos"]
    pieces = split_lines(out.audio_codes[0, : int(out.lengths[0])], out.line_boundaries[0])
    assert [piece[:, 0].tolist() for piece in pieces] == [[5, 6], [7], [8, 9]]


def test_the_separator_stays_masked_for_a_prompt_that_is_not_line_by_line():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6]])
    out = generate(model, *prompt(1), do_sample=False, max_new_tokens=20)
    assert out.line_boundaries == [[]]
    assert out.audio_codes[0, :, 0].tolist() == [5, 0, 6]  # masked: the argmax falls on <|semantic:0|>


def test_the_layouts_line_boundaries_are_read_instead_of_the_ids():
    """`boundaries_left` from the processor's layout decides: the same planted script draws its
    separator on a prompt the layout gives one boundary, and never on one it gives none."""
    scripted = lambda: script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6]])  # noqa: E731
    plain_ids, plain_codes = prompt(1)
    told = generate(scripted(), plain_ids, plain_codes, do_sample=False, max_new_tokens=20, boundaries_left=torch.tensor([1]))
    assert told.line_boundaries == [[1]] and told.audio_codes[0, :, 0].tolist() == [5, 6]
    line_ids, line_codes = line_prompt(1, lines=2)
    none = generate(scripted(), line_ids, line_codes, do_sample=False, max_new_tokens=20, boundaries_left=torch.tensor([0]))
    assert none.line_boundaries == [[]] and none.audio_codes[0, :, 0].tolist() == [5, 0, 6]


def test_the_speak_span_sets_the_frame_budget():
    ids, codes = prompt(1)

    def budget(span):
        model = script_main_tokens(tiny_model(seed=0), [[S + 5] * 200])
        return int(generate(model, ids, codes, do_sample=False, speak_span=torch.tensor([span])).lengths[0])

    # at 2.5x the expected duration, 40 text tokens (more than the floor of 1 s) give a longer budget than 4
    assert budget([0, 40]) > budget([0, 4])


def test_without_the_separator_id_a_line_by_line_prompt_never_draws_it():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6]])
    out = model.generate(*[t[None] for t in line_prompt(1)], do_sample=False, max_new_tokens=20, return_dict_in_generate=True)
    assert out.line_boundaries == [[]] and out.audio_codes[0, :, 0].tolist() == [5, 0, 6]


def test_the_separator_id_may_come_from_the_generation_config():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6]])
    config = GenerationConfig(do_sample=False, max_new_tokens=20, return_dict_in_generate=True)
    config.audio_separator_token_id = SEPARATOR
    out = model.generate(*[t[None] for t in line_prompt(1)], generation_config=config)
    assert out.line_boundaries == [[1]]


def test_no_more_separators_than_the_prompt_has_line_boundaries():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6, SEPARATOR, S + 7]])
    out = generate(model, *line_prompt(1, lines=2), do_sample=False, max_new_tokens=20)
    assert out.line_boundaries == [[1]]
    assert out.audio_codes[0, :, 0].tolist() == [5, 6, 0, 7]


def test_a_continued_prompt_may_draw_only_the_boundaries_it_has_left():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6, SEPARATOR, S + 7]])
    out = generate(model, *line_prompt(1, lines=3, spoken=1), do_sample=False, max_new_tokens=20)
    assert out.line_boundaries == [[1]]


def test_a_semantic_zero_frame_before_a_boundary_is_kept_and_one_before_eos_dropped():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, S, SEPARATOR, S + 3, S]])
    out = generate(model, *line_prompt(1), do_sample=False, max_new_tokens=20)
    assert out.audio_codes[0, :, 0].tolist() == [5, 0, 3]
    assert out.line_boundaries == [[2]] and out.clicks_dropped == [True]
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, S, SEPARATOR]])
    out = generate(model, *line_prompt(1), do_sample=False, max_new_tokens=20)
    assert out.audio_codes[0, :, 0].tolist() == [5, 0]  # then eos: the last line is empty, no click
    assert out.line_boundaries == [[2]] and out.clicks_dropped == [False]


def test_separators_do_not_use_the_frame_budget():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, SEPARATOR, S + 6, SEPARATOR, S + 7, S + 8]])
    out = generate(model, *line_prompt(1), do_sample=False, max_new_tokens=3)
    assert out.audio_codes[0, :, 0].tolist() == [5, 6, 7]
    assert out.line_boundaries == [[1, 2]] and out.finish_reasons == ["length"]


def test_a_streamed_take_releases_a_held_frame_at_a_boundary_and_reports_it():
    model = script_main_tokens(tiny_model(seed=0), [[S + 5, S, SEPARATOR, S + 3, S]])
    chunks = list(model.stream(*line_prompt(1), do_sample=False, max_new_tokens=20, audio_separator_token_id=SEPARATOR))
    assert [int(chunk.codes[0, 0]) for chunk in chunks if chunk.codes.numel()] == [5, 0, 3]
    assert [b for chunk in chunks for b in chunk.line_boundaries] == [2]


# ---- a real tiny model: the separator drawn from its own logits ------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return line_model(seed=0)


def test_greedy_line_by_line_equals_the_full_forward_reference(model):
    ids, codes = line_prompt(2)
    expected, boundaries, _ = reference_greedy_lines(model, ids, codes, max_frames=10, separators=2)
    out = generate(model, ids, codes, do_sample=False, max_new_tokens=10)
    assert boundaries == [2, 7]  # the fixture draws two separators here: the test covers both
    assert out.line_boundaries == [boundaries]
    assert torch.equal(out.audio_codes[0, : int(out.lengths[0])], expected[: int(out.lengths[0])])
    assert int(out.lengths[0]) == expected.shape[0]


def test_a_boundary_row_goes_back_in_with_zero_codes_as_in_the_training_rows(model):
    """The take with its separator rows, run as one teacher-forced forward, predicts the same frames."""
    ids, codes = line_prompt(2)
    out = generate(model, ids, codes, do_sample=False, max_new_tokens=10)
    assert out.line_boundaries == [[2, 7]]
    take = out.audio_codes[0, : int(out.lengths[0])]
    rows_ids, rows_codes = [ids], [codes]
    for piece_index, piece in enumerate(split_lines(take, out.line_boundaries[0])):
        if piece_index:
            rows_ids.append(torch.tensor([SEPARATOR]))
            rows_codes.append(torch.zeros(1, NUM_CODEBOOKS, dtype=torch.long))
        rows_ids.append(piece[:, 0] + SEMANTIC_START)
        rows_codes.append(piece)
    full_ids, full_codes = torch.cat(rows_ids)[None], torch.cat(rows_codes)[None]
    with torch.no_grad():
        forward = model(full_ids, full_codes, restrict_logits=True)
    predicted = forward.codebook_logits[0, :-1].argmax(-1)  # row t predicts codes 1.. of row t + 1
    audio_rows = (full_ids[0, 1:] >= SEMANTIC_START) & (full_ids[0, 1:] < SEMANTIC_START + CODEBOOK_SIZE)
    generated = torch.arange(full_ids.shape[1] - 1) >= ids.shape[0] - 1
    assert torch.equal(predicted[audio_rows & generated], full_codes[0, 1:][audio_rows & generated][:, 1:])


def test_sampled_line_by_line_batch_equals_each_prompt_alone(model):
    prompts = [line_prompt(1), prompt(2), line_prompt(3, lines=2)]
    batch = model.generate(
        *left_pad(prompts), seed=[8, 9, 10], max_new_tokens=12, temperature=1.5, top_p=1.0,
        audio_separator_token_id=SEPARATOR, return_dict_in_generate=True,
    )
    assert any(batch.line_boundaries)
    for item, (ids, codes) in enumerate(prompts):
        alone = generate(model, ids, codes, seed=8 + item, max_new_tokens=12, temperature=1.5, top_p=1.0)
        assert batch.line_boundaries[item] == alone.line_boundaries[0]
        assert torch.equal(batch.audio_codes[item, : int(batch.lengths[item])], alone.audio_codes[0])


def test_a_plain_prompt_draws_the_same_with_or_without_line_by_line_neighbours(model):
    """An item that may not draw the separator draws exactly what it drew before separators existed."""
    ids, codes = prompt(2)
    plain = model.generate(ids[None], codes[None], seed=6, max_new_tokens=12, temperature=1.5, top_p=1.0)
    with_separator_id = generate(model, ids, codes, seed=6, max_new_tokens=12, temperature=1.5, top_p=1.0)
    assert torch.equal(plain, with_separator_id.audio_codes)


def test_stream_equals_generate_with_line_boundaries():
    codec = tiny_codec(seed=0, semantic_codebook_size=CODEBOOK_SIZE).double()
    model = line_model(frame_size=codec.hop_length, sampling_rate=codec.sampling_rate)  # counts the codec's frames
    ids, codes = line_prompt(2)
    settings = dict(seed=303, max_new_tokens=30, temperature=1.5, top_p=1.0, audio_separator_token_id=SEPARATOR)
    offline = model.generate(ids[None], codes[None], codec=codec, return_dict_in_generate=True, **settings)
    chunks = list(model.stream(ids[None], codes[None], codec=codec, windows=iter([5] + [4] * 100), **settings))
    assert offline.line_boundaries[0] == [29, 29]  # two in a row: an empty line, at the end of a chunk (5 + 6 * 4)
    assert [b for chunk in chunks for b in chunk.line_boundaries] == offline.line_boundaries[0]
    for chunk in chunks:
        assert all(b <= chunk.first_frame + chunk.codes.shape[0] for b in chunk.line_boundaries)
    streamed = torch.cat([chunk.codes for chunk in chunks if chunk.codes.numel()])
    assert torch.equal(streamed, offline.audio_codes[0, : int(offline.lengths[0])])
    assert torch.allclose(torch.cat([chunk.audio for chunk in chunks]), offline.audio[0], atol=1e-9)


def test_a_separator_id_inside_the_semantic_band_is_refused(model):
    with pytest.raises(ValueError, match="audio_separator_token_id=70 is not a text token"):
        generate(model, *line_prompt(1), max_new_tokens=2, audio_separator_token_id=70)
