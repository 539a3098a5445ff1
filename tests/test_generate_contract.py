"""generate() keeps GenerationMixin's contract: the properties transformers' GenerationTesterMixin
checks (its test file is not in the source distribution), on the tiny random model.

sequences = prompt rows + one row per step; scores / logits one per step, equal to a
teacher-forced forward over the returned rows; hidden states per step, equal to the backbone's
over the rows; num_return_sequences, each take reproducible from its seed; a left-padded batch
gives each item what it gives alone; the static cache (compiled with fullgraph) gives what the
dynamic one gives, and two inputs of one shape run its graphs without recompiling; position_ids
and inputs_embeds; every option that does not work is refused by name, before any work."""

import inspect

import pytest
import torch
from transformers import CompileConfig, GenerationConfig, GenerationMixin, LogitsProcessorList
from transformers.cache_utils import DynamicCache
from transformers.generation import MaxLengthCriteria, StoppingCriteriaList, TemperatureLogitsWarper

from generation_helpers import (
    CODEBOOK_SIZE, EOS, NUM_CODEBOOKS, SEMANTIC_START, SEPARATOR, left_pad, line_model, line_prompt, prompt,
    script_main_tokens, tiny_model,
)
from transformers_drama3.decoding.loop import compiled_functions
from transformers_drama3.decoding.sampler import filtered_probabilities
from transformers_drama3.decoding.steady_guards import graphs_of
from transformers_drama3.decoding.takes import Drama3GenerationOutput
from transformers_drama3.generation.arguments import ARGUMENTS, GENERATION_FIELDS, NO_EFFECT, REFUSED, WORKS
from transformers_drama3.prompting.bare_rows import spoken_frames

PAD = 7  # a text id of the tiny vocabulary that no prompt here ends in
RUN = dict(max_new_tokens=6, return_dict_in_generate=True, pad_token_id=PAD)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
STATES_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # float32 states of magnitude ~10: a chunked prefill against a recurrent step


@pytest.fixture(scope="module")
def model(random_tiny_model):
    return random_tiny_model


def rows_of(ids, codes):
    """Prompt rows [batch, rows, 1 + num_codebooks] of input_ids [batch, rows] / audio_codes."""
    return torch.cat((ids[..., None], codes), dim=-1)


def take_of(sequence: torch.Tensor) -> torch.Tensor:
    """The frames of one item's sequence rows, read as the processor reads them."""
    return spoken_frames(sequence, SEMANTIC_START, CODEBOOK_SIZE, EOS, PAD, SEPARATOR)


def steps_spoken(out, item: int, prompt_rows: int) -> int:
    """Steps item `item` drew before it ended (its rows up to, and with, eos or its last frame)."""
    return int((out.sequences[item, prompt_rows:, 0] != PAD).sum())


# ---- sequences ------------------------------------------------------------------------------------------


def test_sequences_are_the_prompt_rows_then_one_row_per_step_padded_after_each_end(model):
    ids, codes, mask = left_pad([prompt(1, text_rows=3), prompt(2)])
    scripted = script_main_tokens(tiny_model(seed=0), [[SEMANTIC_START + 4, SEMANTIC_START + 9],
                                                       [SEMANTIC_START + 1] * 4])
    out = scripted.generate(ids, codes, mask, do_sample=False, expected_seconds=5.0, **RUN)
    assert isinstance(out, Drama3GenerationOutput)
    rows = ids.shape[1]
    assert out.sequences.shape == (2, rows + 5, 1 + NUM_CODEBOOKS)  # the longer item: 4 frames, then eos
    assert torch.equal(out.sequences[:, :rows], rows_of(ids, codes))
    drawn = out.sequences[:, rows:, 0].tolist()
    assert drawn == [[SEMANTIC_START + 4, SEMANTIC_START + 9, EOS, PAD, PAD], [SEMANTIC_START + 1] * 4 + [EOS]]
    assert not out.sequences[0, rows + 2:, 1:].any()  # eos and padding rows carry no codes
    for item in range(2):
        length = int(out.lengths[item])
        frames = out.sequences[item, rows : rows + length]
        assert torch.equal(frames[:, 1:], out.audio_codes[item, :length])  # the take is the frames drawn
        assert torch.equal(frames[:, 0], SEMANTIC_START + frames[:, 1])


def test_without_the_dict_generate_returns_the_takes(model):
    ids, codes = prompt(3)
    out = model.generate(ids[None], codes[None], seed=4, **RUN)
    takes = model.generate(ids[None], codes[None], seed=4, max_new_tokens=6)
    assert torch.equal(takes, out.audio_codes)
    assert torch.equal(take_of(out.sequences[0]), out.audio_codes[0, : int(out.lengths[0])])


def test_the_pad_token_defaults_to_eos():
    ids, codes = prompt(1)
    scripted = script_main_tokens(tiny_model(seed=0), [[SEMANTIC_START + 2], [SEMANTIC_START + 2] * 3])
    batch = torch.stack((ids, ids)), torch.stack((codes, codes))
    out = scripted.generate(*batch, do_sample=False, max_new_tokens=6, expected_seconds=5.0, return_dict_in_generate=True)
    assert out.sequences[0, ids.shape[0]:, 0].tolist() == [SEMANTIC_START + 2, EOS, EOS, EOS]


def test_a_regenerated_take_replaces_its_rows_in_sequences():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[EOS] + [SEMANTIC_START + 3] * 8])  # first take too short, the retry 8 frames
    ids, codes = prompt(1)
    out = model.generate(ids[None], codes[None], seed=0, expected_seconds=0.5, regenerate_on_anomaly=2,
                         return_dict_in_generate=True, pad_token_id=PAD)
    assert out.lengths.tolist() == [8] and out.regenerations[0]["kept"]
    assert out.sequences[0, ids.shape[0]:, 0].tolist() == [SEMANTIC_START + 3] * 8 + [EOS]
    assert torch.equal(take_of(out.sequences[0]), out.audio_codes[0])


# ---- scores, logits, hidden states ----------------------------------------------------------------------


def teacher_forced(model, out, prompt_rows: int):
    """forward over the returned rows: the logits that predict each step's row (rows P-1+t)."""
    sequences = out.sequences
    forward = model(sequences[..., 0], sequences[..., 1:])
    return forward.logits[:, prompt_rows - 1 : -1], forward.codebook_logits[:, prompt_rows - 1 : -1]


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(temperature=0.8, top_k=12, top_p=0.9)])
def test_logits_are_one_per_step_and_equal_a_teacher_forced_forward(model, sampling):
    ids, codes = prompt(4)
    out = model.generate(ids[None], codes[None], seed=1, output_logits=True, **sampling, **RUN)
    steps = out.sequences.shape[1] - ids.shape[0]
    vocabulary = model.config.text_config.vocab_size
    assert len(out.logits) == len(out.codebook_logits) == steps
    assert all(step.shape == (1, vocabulary) and step.dtype == torch.float32 for step in out.logits)
    assert all(step.shape == (1, NUM_CODEBOOKS - 1, CODEBOOK_SIZE) for step in out.codebook_logits)
    main, heads = teacher_forced(model, out, ids.shape[0])
    speech = model.speech_token_ids()
    for step in range(steps):
        scored = torch.isfinite(out.logits[step][0])
        assert torch.equal(scored.nonzero().flatten(), speech.sort().values)  # the speech head's ids, -inf elsewhere
        torch.testing.assert_close(out.logits[step][0, speech], main[0, step, speech], **TOLERANCE)
        if step < int(out.lengths[0]):  # a frame: the tower heads were teacher-forced on its codes
            torch.testing.assert_close(out.codebook_logits[step][0], heads[0, step], **TOLERANCE)


def test_scores_are_the_logits_after_the_sampling_warpers(model):
    ids, codes = prompt(5)
    sampled = dict(temperature=0.7, top_k=9, top_p=0.8, repetition_aware=False)
    out = model.generate(ids[None], codes[None], seed=2, output_scores=True, output_logits=True, **sampled, **RUN)
    speech = model.speech_token_ids()
    rows = ids.shape[0]
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        raw = logits[0, speech]
        kept = filtered_probabilities(raw, 0.7, 9, 0.8, keep_crossing=True) > 0
        assert torch.equal(torch.isfinite(scores[0, speech]), kept)
        assert not torch.isfinite(scores[0]).sum() > kept.sum()
        torch.testing.assert_close(scores[0, speech][kept], raw[kept] / 0.7)
        assert torch.isfinite(scores[0, out.sequences[0, rows + step, 0]])  # the drawn token was a candidate
    for step, (scores, logits) in enumerate(zip(out.codebook_scores, out.codebook_logits)):
        kept = filtered_probabilities(logits[0], 0.7, 9, 0.8, keep_crossing=False) > 0
        assert torch.equal(torch.isfinite(scores[0]), kept)
    greedy = model.generate(ids[None], codes[None], do_sample=False, output_scores=True, output_logits=True, **RUN)
    assert all(torch.equal(scores, logits) for scores, logits in zip(greedy.scores, greedy.logits))


def test_scores_make_transition_scores_of_the_drawn_main_tokens(model):
    ids, codes = prompt(6)
    out = model.generate(ids[None], codes[None], seed=3, output_scores=True, repetition_aware=False, **RUN)
    transition = model.compute_transition_scores(out.sequences[..., 0], out.scores, normalize_logits=True)
    assert transition.shape == (1, len(out.scores)) and bool(torch.isfinite(transition).all())
    assert bool((transition <= 0).all())


def test_hidden_states_are_one_per_step_and_equal_the_backbone_over_the_rows(model):
    ids, codes = prompt(7)
    out = model.generate(ids[None], codes[None], seed=5, output_hidden_states=True, **RUN)
    rows, steps = ids.shape[0], out.sequences.shape[1] - ids.shape[0]
    layers = model.config.text_config.num_hidden_layers
    assert len(out.hidden_states) == steps
    assert all(len(states) == layers + 1 for states in out.hidden_states)
    assert out.hidden_states[0][0].shape == (1, rows, model.config.text_config.hidden_size)
    assert all(states[0].shape == (1, 1, model.config.text_config.hidden_size) for states in out.hidden_states[1:])
    sequences = out.sequences
    expected = model.backbone(inputs_embeds=model.embed_rows(sequences[..., 0], sequences[..., 1:]),
                              output_hidden_states=True).hidden_states
    for layer in range(layers + 1):
        torch.testing.assert_close(out.hidden_states[0][layer], expected[layer][:, :rows], **STATES_TOLERANCE)
        for step in range(1, steps):
            torch.testing.assert_close(out.hidden_states[step][layer], expected[layer][:, rows - 1 + step : rows + step],
                                       **STATES_TOLERANCE)


def test_a_line_by_line_prompt_draws_separator_rows_scored_while_a_boundary_is_left():
    model = line_model()
    ids, codes = line_prompt(2)  # greedy: separators after frames 2 and 7
    out = model.generate(ids[None], codes[None], do_sample=False, audio_separator_token_id=SEPARATOR,
                         output_logits=True, expected_seconds=5.0, max_new_tokens=12, return_dict_in_generate=True,
                         pad_token_id=PAD)
    drawn = out.sequences[0, ids.shape[0]:, 0].tolist()
    assert drawn.count(SEPARATOR) == 2 and out.line_boundaries == [[2, 7]]
    last = len(drawn) - 1 - drawn[::-1].index(SEPARATOR)
    scored = [bool(torch.isfinite(step[0, SEPARATOR])) for step in out.logits]
    assert scored == [True] * (last + 1) + [False] * (len(drawn) - last - 1)
    assert torch.equal(take_of(out.sequences[0]), out.audio_codes[0, : int(out.lengths[0])])


# ---- num_return_sequences -------------------------------------------------------------------------------


def test_each_of_num_return_sequences_takes_is_what_its_seed_gives_alone(model):
    prompts = [prompt(8, text_rows=3), prompt(9)]
    ids, codes, mask = left_pad(prompts)
    out = model.generate(ids, codes, mask, seed=10, num_return_sequences=3, temperature=1.5, top_p=1.0,
                         output_scores=True, **RUN)
    assert out.sequences.shape[0] == out.audio_codes.shape[0] == len(out.finish_reasons) == 6
    for index in range(6):
        prompt_ids, prompt_codes = prompts[index // 3]
        alone = model.generate(prompt_ids[None], prompt_codes[None], seed=10 + index, temperature=1.5, top_p=1.0,
                               output_scores=True, **RUN)
        padding = ids.shape[1] - prompt_ids.shape[0]
        length = alone.sequences.shape[1]
        assert torch.equal(out.sequences[index, padding : padding + length], alone.sequences[0])
        assert torch.equal(out.audio_codes[index, : int(alone.lengths[0])], alone.audio_codes[0])
        for step in range(steps_spoken(alone, 0, prompt_ids.shape[0])):
            torch.testing.assert_close(out.scores[step][index], alone.scores[step][0], **TOLERANCE)
    takes = {tuple(out.audio_codes[index].flatten().tolist()) for index in range(3)}
    assert len(takes) > 1  # the takes of one prompt differ


def test_seeds_name_one_per_take(model):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=r"seed has 2 values; .* 1 prompt\(s\) x num_return_sequences 3 = 3"):
        model.generate(ids[None], codes[None], seed=[1, 2], num_return_sequences=3, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_return_sequences=0"):
        model.generate(ids[None], codes[None], num_return_sequences=0, max_new_tokens=2)


# ---- left padding ---------------------------------------------------------------------------------------


def test_a_left_padded_batch_gives_each_item_its_rows_and_scores_alone(model):
    prompts = [prompt(11, text_rows=2), prompt(12, text_rows=9, audio_rows=6), prompt(13)]
    ids, codes, mask = left_pad(prompts)
    out = model.generate(ids, codes, mask, seed=[20, 21, 22], output_logits=True, **RUN)
    for item, (prompt_ids, prompt_codes) in enumerate(prompts):
        alone = model.generate(prompt_ids[None], prompt_codes[None], seed=20 + item, output_logits=True, **RUN)
        padding = ids.shape[1] - prompt_ids.shape[0]
        length = alone.sequences.shape[1]
        assert torch.equal(out.sequences[item, padding : padding + length], alone.sequences[0])
        assert not out.sequences[item, padding + length :, 1:].any()
        for step in range(steps_spoken(alone, 0, prompt_ids.shape[0])):
            torch.testing.assert_close(out.logits[step][item], alone.logits[step][0], **TOLERANCE)


# ---- static cache and the compiled step -----------------------------------------------------------------


FULLGRAPH = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)


@pytest.fixture(scope="module")
def compiled_runs(model):
    """Two different prompts of one shape, generated with cache_implementation="static" through a
    fullgraph compiled step (the CPU compiles when a compile_config is given), and the number of
    graphs the step held after each."""
    runs, graphs = [], []
    for seed in (14, 15):
        ids, codes = prompt(seed)
        runs.append(model.generate(ids[None], codes[None], seed=seed, output_scores=True, output_logits=True,
                                   cache_implementation="static", compile_config=FULLGRAPH, **RUN))
        graphs.append(graphs_of(compiled_functions(FULLGRAPH).step))
    return runs, graphs


def test_the_static_cache_gives_the_rows_and_logits_of_the_dynamic_one(model, compiled_runs):
    for seed, static in zip((14, 15), compiled_runs[0]):
        ids, codes = prompt(seed)
        dynamic = model.generate(ids[None], codes[None], seed=seed, output_scores=True, output_logits=True, **RUN)
        assert torch.equal(static.sequences, dynamic.sequences)
        for name in ("scores", "logits", "codebook_scores", "codebook_logits"):
            for mine, theirs in zip(getattr(static, name), getattr(dynamic, name), strict=True):
                assert torch.equal(torch.isfinite(mine), torch.isfinite(theirs)), name
                torch.testing.assert_close(mine, theirs, **TOLERANCE)


def test_a_second_input_of_the_same_shape_runs_the_compiled_graphs_without_recompiling(compiled_runs):
    first, second = compiled_runs[1]
    assert first >= 1 and second == first


def test_the_eager_static_cache_gives_the_dynamic_rows(model):
    ids, codes = prompt(16)
    static = model.generate(ids[None], codes[None], seed=3, cache_implementation="static", disable_compile=True, **RUN)
    dynamic = model.generate(ids[None], codes[None], seed=3, **RUN)
    assert torch.equal(static.sequences, dynamic.sequences)


# ---- position_ids and inputs_embeds ---------------------------------------------------------------------


def test_position_ids_are_taken_where_they_are_the_prompts_positions(model):
    ids, codes, mask = left_pad([prompt(17, text_rows=2), prompt(18)])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as transformers' tests build them
    given = model.generate(ids, codes, mask, seed=1, position_ids=positions, **RUN)
    assert torch.equal(given.sequences, model.generate(ids, codes, mask, seed=1, **RUN).sequences)
    first_real = int((mask[0] == 0).sum())
    with pytest.raises(ValueError, match=rf"position_ids\[0, {first_real}\] = 1; .* \(0 here"):
        model.generate(ids, codes, mask, position_ids=positions + 1, **RUN)
    with pytest.raises(ValueError, match="position_ids has shape"):
        model.generate(ids, codes, mask, position_ids=positions[:, 1:], **RUN)


def test_inputs_embeds_are_what_the_backbone_reads_for_the_prompt(model):
    ids, codes = prompt(19)
    embeds = model.embed_rows(ids[None], codes[None])
    plain = model.generate(ids[None], codes[None], seed=6, output_logits=True, **RUN)
    given = model.generate(ids[None], codes[None], seed=6, inputs_embeds=embeds, output_logits=True, **RUN)
    assert torch.equal(given.sequences, plain.sequences)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(given.logits, plain.logits))
    moved = model.generate(ids[None], codes[None], seed=6, inputs_embeds=embeds * 1.5, output_logits=True, **RUN)
    assert not torch.allclose(moved.logits[0], plain.logits[0])
    with pytest.raises(ValueError, match="inputs_embeds needs input_ids"):
        model.generate(inputs_embeds=embeds, **RUN)
    with pytest.raises(ValueError, match="inputs_embeds has shape"):
        model.generate(ids[None], codes[None], inputs_embeds=embeds[..., :-1], **RUN)


def test_inputs_embeds_go_with_each_of_several_takes(model):
    ids, codes = prompt(20)
    embeds = model.embed_rows(ids[None], codes[None])
    out = model.generate(ids[None], codes[None], seed=4, inputs_embeds=embeds * 1.5, num_return_sequences=2, **RUN)
    second = model.generate(ids[None], codes[None], seed=5, inputs_embeds=embeds * 1.5, **RUN)
    assert torch.equal(out.sequences[1, : second.sequences.shape[1]], second.sequences[0])


# ---- refusals ---------------------------------------------------------------------------------------------


REFUSED_VALUES = {
    "num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 0.5, "length_penalty": 2.0, "early_stopping": True,
    "constraints": ["x"], "force_words_ids": [[5]], "is_assistant": True, "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.4,
    "prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2, "assistant_early_exit": 1,
    "assistant_lookbehind": 10, "target_lookbehind": 10, "assistant_ensemble_weight": 0.5,
    "speculation_type": "draft", "use_mtp": True, "penalty_alpha": 0.6, "dola_layers": "high", "low_memory": True,
    "top_h": 0.5, "typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 3e-4,
    "repetition_penalty": 1.2, "encoder_repetition_penalty": 1.1, "no_repeat_ngram_size": 2,
    "encoder_no_repeat_ngram_size": 2, "bad_words_ids": [[5]], "sequence_bias": {(5,): -1.0},
    "suppress_tokens": [5], "begin_suppress_tokens": [5], "forced_bos_token_id": 5, "forced_eos_token_id": 5,
    "renormalize_logits": True, "remove_invalid_values": True, "exponential_decay_length_penalty": (5, 1.1),
    "token_healing": True, "guidance_scale": 1.5, "watermarking_config": {"bias": 2.0}, "min_length": 5,
    "min_new_tokens": 5, "max_time": 1.0, "stop_strings": ["x"], "max_length": 30, "cache_config": {"x": 1},
    "max_cache_len": 64, "prefill_chunk_size": 8, "continuous_batching_config": {"x": 1}, "use_cache": False,
    "output_attentions": True,
}


def unstarted_model():
    """A tiny model whose prefill fails: a refusal that comes after any work shows as that failure."""
    model = tiny_model(seed=0)

    def prefill(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    model.prefill = prefill
    return model


@pytest.fixture(scope="module")
def unstarted():
    return unstarted_model()


def test_every_generation_config_field_is_sorted_into_works_or_refused():
    assert GENERATION_FIELDS <= WORKS | NO_EFFECT | REFUSED.keys()
    assert REFUSED.keys() == REFUSED_VALUES.keys()
    arguments = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "inputs", "generation_config",
                                                                                   "streamer", "kwargs"}
    assert arguments <= ARGUMENTS.keys()


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_an_option_that_would_not_work_is_refused_by_name_before_any_work(unstarted, name):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=rf"^{name}="):
        unstarted.generate(ids[None], codes[None], **{name: REFUSED_VALUES[name]})


@pytest.mark.parametrize("name, value", [
    ("assistant_model", "self"), ("assistant_tokenizer", object()),
    ("logits_processor", LogitsProcessorList([TemperatureLogitsWarper(0.5)])),
    ("prefix_allowed_tokens_fn", lambda batch, ids: [5]), ("negative_prompt_ids", torch.tensor([[5]])),
    ("negative_prompt_attention_mask", torch.tensor([[1]])),
    ("stopping_criteria", StoppingCriteriaList([MaxLengthCriteria(5)])), ("tokenizer", object()),
    ("synced_gpus", True), ("custom_generate", "transformers-community/dola"), ("past_key_values", DynamicCache()),
    ("cache", DynamicCache()), ("use_model_defaults", False),
])
def test_generation_mixin_arguments_that_would_not_work_are_refused_by_name(unstarted, name, value):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=rf"^{name}="):
        unstarted.generate(ids[None], codes[None], **{name: unstarted if value == "self" else value})


def test_refused_fields_are_refused_from_a_generation_config_and_the_models_own(unstarted):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=r"^generation_config\.repetition_penalty=1\.2: this logits processor"):
        unstarted.generate(ids[None], codes[None], generation_config=GenerationConfig(repetition_penalty=1.2))
    model = unstarted_model()
    model.generation_config.num_beams = 4
    with pytest.raises(ValueError, match=r"^the model's generation_config\.num_beams=4: beam search"):
        model.generate(ids[None], codes[None])


def test_the_values_that_change_nothing_are_accepted(model):
    ids, codes = prompt(1)
    neutral = dict(num_beams=1, repetition_penalty=1.0, use_cache=True, output_attentions=False, length_penalty=1.0,
                   early_stopping=False, logits_processor=LogitsProcessorList(), stopping_criteria=None,
                   synced_gpus=False, bos_token_id=3, eos_token_id=EOS)
    out = model.generate(ids[None], codes[None], seed=0, **neutral, **RUN)
    assert torch.equal(out.sequences, model.generate(ids[None], codes[None], seed=0, **RUN).sequences)
    with pytest.raises(ValueError, match="^num_beams=True"):
        model.generate(ids[None], codes[None], num_beams=True)


@pytest.mark.parametrize("call, message", [
    (dict(eos_token_id=5), r"^eos_token_id=5: a Drama 3 take ends on <\|im_end\|>"),
    (dict(output_scores=True), "output_scores=True needs return_dict_in_generate=True"),
    (dict(output_hidden_states=True, return_dict_in_generate=True, cache_implementation="static",
          compile_config=FULLGRAPH), "output_hidden_states=True needs the eager decode step"),
    (dict(output_logits=True, return_dict_in_generate=True, regenerate_on_anomaly=1),
     "regenerate_on_anomaly cannot be combined with output_scores"),
    (dict(return_dict_in_generate="yes"), "return_dict_in_generate='yes'"),
    (dict(pad_token_id=10**6), r"pad_token_id=1000000; expected a token id"),
])
def test_combinations_that_would_not_work_are_refused_before_any_work(unstarted, call, message):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=message):
        unstarted.generate(ids[None], codes[None], **call)


def test_stream_refuses_what_only_generate_returns(unstarted):
    ids, codes = prompt(1)
    for name, value in (("output_scores", True), ("num_return_sequences", 2), ("return_dict_in_generate", True)):
        with pytest.raises(ValueError, match=rf"^{name}={value}: stream\(\) yields audio chunks"):
            next(unstarted.stream(ids[None], codes[None], **{name: value}))
    with pytest.raises(ValueError, match="^num_beams=2"):
        next(unstarted.stream(ids[None], codes[None], num_beams=2))


# ---- the rows read back as a take (the processor's decode of sequences) ----------------------------------


def frame_row(code: int) -> list[int]:
    return [SEMANTIC_START + code, code, 1, 2, 3]


def text_row(token: int) -> list[int]:
    return [token, 0, 0, 0, 0]


def test_spoken_frames_are_the_voice_turns_frames_without_separators_and_the_click_before_eos():
    prompt_rows = [text_row(5), frame_row(1), text_row(3)]  # a reference frame, then the voice turn opens
    drawn = [frame_row(2), text_row(SEPARATOR), frame_row(4), frame_row(0), text_row(EOS), text_row(PAD)]
    frames = take_of(torch.tensor(prompt_rows + drawn))
    assert frames.tolist() == [frame_row(2)[1:], frame_row(4)[1:]]
    budget_ended = take_of(torch.tensor(prompt_rows + [frame_row(2), frame_row(0), text_row(PAD)]))
    assert budget_ended.tolist() == [frame_row(2)[1:], frame_row(0)[1:]]  # no eos: the last frame is no click
    continued = take_of(torch.tensor(prompt_rows + [frame_row(6)] + drawn))  # the voice turn held a frame already
    assert continued.tolist() == [frame_row(6)[1:], frame_row(2)[1:], frame_row(4)[1:]]


def test_the_processor_decodes_sequences_to_the_takes_audio(speech_bundle):
    model, processor = speech_bundle
    inputs = processor(["A first line.", "And a second, longer one."])
    out = model.generate(**inputs, seed=3, max_new_tokens=6, return_dict_in_generate=True,
                         pad_token_id=processor.tokenizer.pad_token_id)
    takes = [out.audio_codes[item, : int(out.lengths[item])] for item in range(2)]
    for item, take in enumerate(takes):
        assert torch.equal(processor.spoken_frames(out.sequences[item]), take)
    from_takes = processor.batch_decode(takes)
    for from_rows, expected in zip(processor.decode(out.sequences), from_takes, strict=True):
        assert torch.equal(from_rows, expected)
    with pytest.raises(ValueError, match="lengths: sequences"):
        processor.batch_decode(out.sequences, lengths=[1, 1])
