"""Phoneme-aligned decoding: the tracker's rule (forward only, at most `skip` phonemes skipped,
eos only at the end, bounded silence), its table is checked before any work, and generate() and
the serving engine draw only what it allows (replayed through a fresh tracker), the same codes
alone and through the engine; `phoneme_alignment=False` gives the unconstrained draws."""

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import CODEBOOK_SIZE, NUM_CODEBOOKS, prompt, tiny_model
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.alignment import AlignmentTracker, PhonemeAlignment, turn_token_ids
from transformers_drama3.serving.engine import Drama3Engine, SpeechJob

SILENCE = 0


def tracker(rows, token_ids=None, **options) -> AlignmentTracker:
    """A tracker over phoneme tokens 10, 11, ... whose codes are `rows` (the text: those tokens in
    order, or `token_ids`)."""
    table = PhonemeAlignment({10 + index: frozenset(row) for index, row in enumerate(rows)}, codebooks=(0, 2, 3),
                             silence=SILENCE, **options)
    return AlignmentTracker(table, [token_ids or [10 + index for index in range(len(rows))]], CODEBOOK_SIZE)


def allowed_codes(track: AlignmentTracker) -> set[int]:
    return set(track.allowed()[0].nonzero().flatten().tolist())


def draw(track: AlignmentTracker, *codes: int) -> None:
    for code in codes:
        track.observe(torch.tensor([code]), torch.tensor([True]))


def test_the_tracker_moves_forward_only_and_skips_at_most_one_phoneme():
    track = tracker([{1}, {2}, {3}, {4}], skip=1)
    assert allowed_codes(track) == {SILENCE, 1, 2}  # the first phoneme, or the second (one skipped)
    draw(track, 1, 1, SILENCE, 1)
    assert allowed_codes(track) == {SILENCE, 1, 2, 3}
    draw(track, 2)
    assert allowed_codes(track) == {SILENCE, 2, 3, 4}  # 1 is behind: a loop back cannot be drawn
    draw(track, 4)
    assert track.state == [3] and allowed_codes(track) == {SILENCE, 4}


def test_a_code_shared_by_neighbours_moves_forward_when_it_starts_and_stays_while_it_lasts():
    track = tracker([{5, 6}, {6}, {7}, {8}], skip=1)
    draw(track, 5, 6)
    assert track.state == [1]
    draw(track, 6, 6)
    assert track.state == [1]
    draw(track, 7)
    assert track.state == [2]


def test_eos_is_masked_until_the_last_phonemes_and_silence_is_bounded():
    track = tracker([{1}, {2}, {3}, {4}], skip=1, end_slack=1, max_silence=3)
    logits = torch.zeros(1, 1, CODEBOOK_SIZE + 1)
    assert torch.isinf(track.main_logits(logits)[0, 0, CODEBOOK_SIZE])
    draw(track, SILENCE, SILENCE, SILENCE)
    assert SILENCE not in allowed_codes(track)  # three silences in a row before the end: speak
    draw(track, 1, SILENCE)
    assert SILENCE in allowed_codes(track)
    draw(track, 2, 3)
    assert not torch.isinf(track.main_logits(logits)[0, 0, CODEBOOK_SIZE])  # within one phoneme of the last
    draw(track, SILENCE, SILENCE, SILENCE, SILENCE)
    assert SILENCE in allowed_codes(track)  # at the end, pauses are free


@pytest.mark.parametrize(
    "value, message",
    [
        ("yes", "expected a dict"),
        ({"tokens": {}}, "tokens"),
        ({"tokens": {"7": [CODEBOOK_SIZE]}}, r"tokens\['7'\]"),
        ({"tokens": {"x": [1]}}, "not a token id"),
        ({"tokens": {"7": [1]}, "codebooks": [2, 3]}, "codebooks"),
        ({"tokens": {"7": [1]}, "codebooks": [0, NUM_CODEBOOKS]}, "codebooks"),
        ({"tokens": {"7": [1]}, "skip": -1}, "skip"),
        ({"tokens": {"7": [1]}, "max_silence": 0}, "max_silence"),
        ({"tokens": {"7": [1]}, "silence": CODEBOOK_SIZE}, "silence"),
        ({"tokens": {"7": [1]}, "window": 3}, "unknown keys"),
    ],
)
def test_a_bad_table_is_refused_before_any_work(value, message):
    model = tiny_model(seed=0)
    model.generation_config.phoneme_alignment = value
    ids, codes = prompt(seed=1)
    with pytest.raises(ValueError, match=message):
        model.generate(ids[None], codes[None], max_new_tokens=4)


def aligned_model(ids: torch.Tensor, seed: int = 0, float64: bool = False):
    """`tiny_model(seed)` whose generation config aligns every text token of the turn to speak in
    `ids` to two codes of its own. `float64`: for comparing a batch or the engine with a prompt
    alone, whose float32 sums round differently and may flip a draw that sits on a tie (as in
    tests/test_serving_engine.py)."""
    model = tiny_model(seed=seed)
    if float64:
        model.set_experts_implementation("eager")  # the grouped-GEMM experts take no float64
        model = model.double()
    turn = turn_token_ids(ids[None], torch.ones_like(ids)[None], model.config.eos_token_id)[0]
    tokens = {str(token): [1 + (2 * index) % (CODEBOOK_SIZE - 2), 2 + (2 * index) % (CODEBOOK_SIZE - 2)]
              for index, token in enumerate(dict.fromkeys(turn))}
    model.generation_config.phoneme_alignment = {"codebooks": [0, 2, 3], "silence": SILENCE, "skip": 1,
                                                 "end_slack": 1, "max_silence": 4, "tokens": tokens}
    return model


def replay(model, ids: torch.Tensor, take: torch.Tensor, finish: str) -> None:
    """Every phoneme code of `take` [frames, C] was allowed where it was drawn; an eos take ended at
    the end of its text."""
    alignment = PhonemeAlignment.from_value(model.generation_config.phoneme_alignment, CODEBOOK_SIZE, NUM_CODEBOOKS)
    turn = turn_token_ids(ids[None], torch.ones_like(ids)[None], model.config.eos_token_id)[0]
    track = AlignmentTracker(alignment, [turn], CODEBOOK_SIZE)
    for frame in take.tolist():
        for codebook in alignment.codebooks:
            assert frame[codebook] in allowed_codes(track), (frame, codebook, track.state)
            draw(track, frame[codebook])
    if finish == "eos":
        assert track.may_end(0)


@pytest.mark.parametrize("prompt_seed", [1, 2, 3])
def test_generate_draws_only_what_the_alignment_allows(prompt_seed):
    ids, codes = prompt(seed=prompt_seed, tail_rows=6)
    model = aligned_model(ids)
    out = model.generate(ids[None], codes[None], seed=prompt_seed, temperature=1.5, top_p=1.0,
                         max_new_tokens=60, return_dict_in_generate=True)
    take = out.audio_codes[0, : int(out.lengths[0])]
    assert take.shape[0] > 0
    replay(model, ids, take, out.finish_reasons[0])
    free = model.generate(ids[None], codes[None], seed=prompt_seed, temperature=1.5, top_p=1.0,
                          max_new_tokens=60, return_dict_in_generate=True, phoneme_alignment=False)
    plain = tiny_model(seed=0).generate(ids[None], codes[None], seed=prompt_seed, temperature=1.5, top_p=1.0,
                                        max_new_tokens=60, return_dict_in_generate=True)
    assert torch.equal(free.audio_codes, plain.audio_codes)  # off: the unconstrained draws, bit for bit
    assert not torch.equal(free.audio_codes, out.audio_codes)


def test_a_batch_aligns_each_item_to_its_own_text_and_a_regeneration_starts_over():
    ids, codes = prompt(seed=4, tail_rows=6)
    model = aligned_model(ids, float64=True)
    batch = model.generate(torch.stack([ids, ids]), torch.stack([codes, codes]), seed=[5, 6], temperature=1.5,
                           top_p=1.0, max_new_tokens=60, return_dict_in_generate=True)
    for item in range(2):
        alone = model.generate(ids[None], codes[None], seed=5 + item, temperature=1.5, top_p=1.0,
                               max_new_tokens=60, return_dict_in_generate=True)
        assert torch.equal(batch.audio_codes[item, : int(batch.lengths[item])], alone.audio_codes[0, : int(alone.lengths[0])])
        replay(model, ids, alone.audio_codes[0, : int(alone.lengths[0])], alone.finish_reasons[0])


def test_alignment_runs_on_a_static_cache_and_through_a_compiled_step_as_it_runs_eagerly():
    """The alignment is masks on fixed shapes: a static cache and a compiled step (dynamo's whole
    graph, run by its eager backend) align as the default run does."""
    ids, codes = prompt(seed=1, tail_rows=6)
    model = aligned_model(ids)
    default = model.generate(ids[None], codes[None], max_new_tokens=12, seed=3)
    static = model.generate(ids[None], codes[None], max_new_tokens=12, seed=3, cache_implementation="static",
                            disable_compile=True)
    torch._dynamo.reset()
    compiled = model.generate(ids[None], codes[None], max_new_tokens=12, seed=3, cache_implementation="static",
                              compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    assert default.shape[1] > 0 and torch.equal(default, static) and torch.equal(default, compiled)


@pytest.mark.parametrize("options", [
    dict(skip=1), dict(skip=0, end_slack=0), dict(skip=2, max_silence=3, short_silence=2, quiet_tokens=[4]),
    dict(resume_after_pause=False, max_stay=3), dict(release=1.2, max_stay=4),
], ids=["default", "no-skip", "short-silences", "no-resume", "release"])
def test_the_masks_follow_the_tracker_they_restate(options):
    """`AlignmentMasks` (tensors, what the step runs) against `AlignmentTracker` (item by item, the
    reference): the same allowed codes, the same ends, the same positions after every observed
    code, over random texts and random codes (an empty text, a repeated phoneme and silences
    included), items drawing or not."""
    from transformers_drama3.decoding.alignment import AlignmentMasks

    generator = torch.Generator().manual_seed(7)
    size = 12
    table = {str(token): sorted({int(c) for c in torch.randint(1, size, (3,), generator=generator)}) for token in range(20, 30)}
    alignment = PhonemeAlignment.from_value({"tokens": table, "codebooks": [0, 2], **options}, size, NUM_CODEBOOKS)
    texts = [[], [20, 4, 21, 5, 22, 22, 23], [25, 26, 27, 28, 29, 24, 23, 22], [21, 4, 4, 20]]
    expected = [6.0, 5.0, 8.0, 3.0]
    reference = AlignmentTracker(alignment, texts, size, expected)
    masks = AlignmentMasks(alignment, texts, size, expected)
    for step in range(160):
        assert torch.equal(masks.allowed(), reference.allowed()), step
        assert masks.may_end_mask().tolist() == [reference.may_end(item) for item in range(len(texts))], step
        # draw mostly what is allowed (as a sampler would), sometimes anything
        allowed = reference.allowed()
        choice = torch.rand(len(texts), size, generator=generator) + allowed.float() * (torch.rand(()) < 0.9)
        codes = choice.argmax(dim=-1)
        drawing = torch.rand(len(texts), generator=generator) < 0.85
        reference.observe(codes, drawing)
        masks.observe(codes, drawing)
        assert masks.position.tolist() == reference.state, step
        assert masks.stay.tolist() == reference.stay and masks.silent_run.tolist() == reference.silent_run, step
    assert max(reference.state) >= 3  # the walk got somewhere


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_engine_aligns_a_request_as_generate_does(compiled):
    """Eagerly, and through the compiled step in batch-size buckets (dynamo's whole graph, run by
    its eager backend; float64 with the batched-matmul experts, which a graph holds)."""
    ids, codes = prompt(seed=2, tail_rows=6)
    model = aligned_model(ids, float64=True)
    options = {}
    if compiled:
        model.set_experts_implementation("batched_mm")
        torch._dynamo.reset()
        options["compile_config"] = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    job = SpeechJob(ids[None], codes[None], SamplingSettings(temperature=1.5, top_p=1.0), seed=9, max_new_tokens=60)
    other = SpeechJob(*(t[None] for t in prompt(seed=3, tail_rows=4)), SamplingSettings(), seed=4, max_new_tokens=20)
    engine = Drama3Engine(model, max_batch=4, **options)
    handle, _ = engine.submit(job), engine.submit(other)
    while not engine.idle:
        engine.step()
    result = handle.result(timeout=1)
    model.set_experts_implementation("eager")
    alone = model.generate(ids[None], codes[None], seed=9, temperature=1.5, top_p=1.0, max_new_tokens=60,
                           return_dict_in_generate=True)
    assert torch.equal(result.codes, alone.audio_codes[0, : int(alone.lengths[0])])
    replay(model, ids, result.codes, result.finish_reason)


def test_an_item_that_stays_too_long_on_one_phoneme_is_pushed_to_the_next():
    track = tracker([{1}, {2, 9}, {9}, {4}], skip=1, max_stay=4, max_silence=10)
    draw(track, 1, 2, 2, SILENCE, 2)
    assert allowed_codes(track) == {SILENCE, 2, 9, 4}
    draw(track, 2)  # the fifth sub-frame on phoneme 2
    assert allowed_codes(track) == {9, 4}  # neither the phoneme nor a pause: move on
    draw(track, 9)
    assert track.state == [2] and SILENCE in allowed_codes(track)


def test_without_resuming_after_a_pause_a_stutter_cannot_be_drawn():
    track = tracker([{1}, {2}, {3}, {4}], skip=1, resume_after_pause=False)
    draw(track, 1, 2)
    assert 2 in allowed_codes(track)
    draw(track, SILENCE)
    assert allowed_codes(track) == {SILENCE, 3, 4}  # "2 - 2" would be a stutter: after the pause, on
    resuming = tracker([{1}, {2}, {3}, {4}], skip=1)
    draw(resuming, 1, 2, SILENCE)
    assert 2 in allowed_codes(resuming)


def test_pauses_are_short_inside_words_and_between_them_and_long_where_the_text_pauses():
    boundary, comma = 90, 91  # a word boundary (quiet) and a comma (not quiet)
    text = [10, 11, boundary, 12, comma, 13, 14]
    track = tracker([{1}, {2}, {3}, {4}, {5}], token_ids=text, quiet_tokens=frozenset({boundary}), short_silence=2,
                    max_silence=5)
    assert track.pauses == [[False, False, True, False, True]]
    draw(track, SILENCE, SILENCE, SILENCE)  # before the first phoneme: a long pause
    assert SILENCE in allowed_codes(track)
    draw(track, 1, SILENCE, SILENCE)  # inside the word
    assert SILENCE not in allowed_codes(track)
    draw(track, 2, SILENCE, SILENCE)  # at the word boundary
    assert SILENCE not in allowed_codes(track)
    draw(track, 3, SILENCE, SILENCE, SILENCE, SILENCE)  # at the comma
    assert SILENCE in allowed_codes(track)
    draw(track, SILENCE)
    assert SILENCE not in allowed_codes(track)


def test_a_take_that_outlasts_its_release_is_let_go():
    table = PhonemeAlignment({10: frozenset({1}), 11: frozenset({2}), 12: frozenset({3}), 13: frozenset({4})},
                             codebooks=(0, 2), silence=SILENCE, release=1.5)
    track = AlignmentTracker(table, [[10, 11, 12, 13]], CODEBOOK_SIZE, expected_frames=[4])
    logits = torch.zeros(1, 1, CODEBOOK_SIZE + 1)
    draw(track, *[1] * 11)  # 11 sub-frames: under 1.5 x 4 frames x 2 codebooks
    assert torch.isinf(track.main_logits(logits)[0, 0, CODEBOOK_SIZE]) and 7 not in allowed_codes(track)
    draw(track, 1)
    assert not torch.isinf(track.main_logits(logits)[0, 0, CODEBOOK_SIZE]) and allowed_codes(track) == set(range(CODEBOOK_SIZE))


def test_the_bundled_table_aligns_every_phoneme_of_the_evaluation_sentences(bundled_tiny):
    """drama3-tiny's table (learned by the recipe) covers every phoneme token of `drama3 eval`'s
    held-out and development sentences: none is spoken unaligned. Its quiet tokens are the word
    boundary and the stress marks."""
    from pathlib import Path

    from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES
    from transformers_drama3.decoding.alignment import resolve_alignment
    from transformers_drama3.prompting.phonemes import PUNCTUATION, phoneme_symbol

    model, processor = bundled_tiny
    alignment = resolve_alignment(model, [])
    assert alignment is not None and alignment.codebooks == (0, 2, 3, 4)
    vocabulary = processor.tokenizer.convert_ids_to_tokens
    assert sorted(phoneme_symbol(vocabulary(t)) for t in alignment.quiet_tokens) == sorted([" ", "ˈ", "ˌ"])
    development = Path(__file__).resolve().parent.parent / "recipes" / "drama3_tiny" / "dev_sentences.txt"
    sentences = [*HELDOUT_SENTENCES, *development.read_text(encoding="utf-8").split("\n")]
    for sentence in filter(None, sentences):
        inputs = processor(sentence)
        start, stop = inputs["speak_span"][0].tolist()
        ids = inputs["input_ids"][0, start:stop].tolist()
        spoken = [t for t in ids if (s := phoneme_symbol(vocabulary(t))) is not None and s not in " ˈˌ" + PUNCTUATION]
        assert spoken and all(t in alignment.tokens for t in spoken), sentence
        assert len(alignment.rows(ids)) == len(spoken)
