"""The continuous-batching engine: a request's codes equal `generate()`'s for it alone, whether it
runs alone or joins a busy batch mid-flight; slots free at once; the queue has a cap."""

from dataclasses import replace

import pytest
import torch

from generation_helpers import prompt, recorded_step_order, tiny_model
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.steady_guards import graphs_of
from transformers_drama3.serving.engine import (
    DoneEvent, Drama3Engine, ErrorEvent, FramesEvent, QueueFull, SpeechJob, prefill_alone,
)

MAX_FRAMES = 8
FLOAT32 = dict(rtol=1.3e-6, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    # float64: batch compositions round differently (~1e-6 in float32), which may flip a draw that
    # sits within rounding of a tie; in float64 no draw is that close, so codes compare exactly
    model = tiny_model(seed=0)
    model.set_experts_implementation("eager")  # the grouped-GEMM experts take no float64
    return model.double()


@pytest.fixture
def make_engine(model):
    return lambda **options: Drama3Engine(model, **options)


def job(seed: int, prompt_seed: int, text_rows: int = 5, audio_rows: int = 4, **settings) -> SpeechJob:
    ids, codes = prompt(seed=prompt_seed, text_rows=text_rows, audio_rows=audio_rows)
    sampling = SamplingSettings(**settings) if settings else SamplingSettings()
    return SpeechJob(ids[None], codes[None], sampling, seed=seed, max_new_tokens=MAX_FRAMES)


def generate_alone(model, job: SpeechJob):
    settings = job.settings
    out = model.generate(
        job.input_ids, job.audio_codes, seed=job.seed, max_new_tokens=job.max_new_tokens,
        do_sample=settings.do_sample, temperature=settings.temperature, top_p=settings.top_p,
        top_k=settings.top_k, min_p=settings.min_p, return_dict_in_generate=True,
    )
    return out.audio_codes[0, : int(out.lengths[0])], out.finish_reasons[0]


def drive(engine, arrivals: dict):
    """Step the engine by hand; `arrivals[step]` lists jobs submitted before that step."""
    handles, step = [], 0
    while step <= max(arrivals) or not engine.idle:
        handles += [engine.submit(j) for j in arrivals.get(step, [])]
        engine.step()
        step += 1
    return handles


def test_a_request_alone_gives_generates_codes(model, make_engine):
    request = job(seed=3, prompt_seed=1, temperature=1.3, top_p=1.0)
    engine = make_engine(max_batch=4)
    (handle,) = drive(engine, {0: [request]})
    result = handle.result(timeout=1)
    expected, reason = generate_alone(model, request)
    assert isinstance(result, DoneEvent)
    assert torch.equal(result.codes, expected)
    assert result.finish_reason == reason


def test_requests_joining_a_busy_batch_mid_flight_give_their_codes_alone(model, make_engine):
    first = [job(seed=10 + i, prompt_seed=20 + i, text_rows=3 + 2 * i, temperature=1.2, top_p=0.95) for i in range(2)]
    later = [
        job(seed=30, prompt_seed=31, audio_rows=7, temperature=0.8, top_k=5),
        job(seed=32, prompt_seed=33, text_rows=9),
        job(seed=34, prompt_seed=35, do_sample=False),
        job(seed=150, prompt_seed=80, temperature=0.5, top_p=1.0, min_p=0.5),
    ]
    engine = make_engine(max_batch=8)
    handles = drive(engine, {0: first, 3: later[:2], 5: later[2:]})
    for request, handle in zip(first + later, handles):
        result = handle.result(timeout=1)
        expected, reason = generate_alone(model, request)
        assert torch.equal(result.codes, expected), f"seed {request.seed}"
        assert result.finish_reason == reason
    assert engine.stats.occupied > engine.stats.steps  # requests did share steps


def test_streamed_frames_join_to_the_final_codes(model):
    engine = Drama3Engine(model)
    (handle,) = drive(engine, {0: [job(seed=5, prompt_seed=6)]})
    events = list(handle.events(timeout=1))
    frames = torch.cat([event.frames for event in events if isinstance(event, FramesEvent)])
    assert torch.equal(frames, events[-1].codes)


def test_waiting_requests_beyond_max_batch_run_when_a_slot_frees(model):
    requests = [job(seed=40 + i, prompt_seed=50 + i) for i in range(3)]
    engine = Drama3Engine(model, max_batch=1)
    handles = drive(engine, {0: requests})
    assert engine.stats.occupied == engine.stats.steps  # never more than one at a time
    for request, handle in zip(requests, handles):
        assert torch.equal(handle.result(timeout=1).codes, generate_alone(model, request)[0])


def test_a_cancelled_request_leaves_at_the_next_step_and_others_are_unchanged(model, make_engine):
    keep, drop = job(seed=60, prompt_seed=61), job(seed=62, prompt_seed=63, temperature=1.5, top_p=1.0)
    engine = make_engine()
    handles = [engine.submit(keep), engine.submit(drop)]
    engine.step()
    handles[1].cancel()
    engine.step()
    assert handles[1].finished_at is not None  # freed at the step after the cancel
    assert engine.running == (0 if handles[0].finished_at is not None else 1)
    while not engine.idle:
        engine.step()
    cancelled = handles[1].result(timeout=1)
    assert isinstance(cancelled, ErrorEvent) and cancelled.kind == "cancelled"
    assert torch.equal(handles[0].result(timeout=1).codes, generate_alone(model, keep)[0])


def test_submit_beyond_the_queue_cap_is_refused(model):
    engine = Drama3Engine(model, max_batch=1, max_queue=2)
    engine.submit(job(seed=1, prompt_seed=1))
    engine.submit(job(seed=2, prompt_seed=2))
    with pytest.raises(QueueFull, match="queue holds 2"):
        engine.submit(job(seed=3, prompt_seed=3))


def test_the_scheduler_thread_serves_concurrent_requests(model):
    requests = [job(seed=70 + i, prompt_seed=80 + i, text_rows=2 + i) for i in range(5)]
    engine = Drama3Engine(model, max_batch=3)
    engine.start()
    try:
        handles = [engine.submit(request) for request in requests]
        results = [handle.result(timeout=30) for handle in handles]
    finally:
        engine.stop()
    for request, result in zip(requests, results):
        assert torch.equal(result.codes, generate_alone(model, request)[0])


def test_a_prefill_continued_from_a_cached_prefix_matches_the_whole_prefill(model):
    from transformers_drama3.serving.prefix_cache import continue_prefill, prefill_prefix

    # float32 tolerances: the tower's RoPE runs in float32 whatever the model's dtype
    request = job(seed=1, prompt_seed=90, audio_rows=6)
    whole = prefill_alone(model, request)
    rows = 7
    prefix = prefill_prefix(model, request.input_ids[:, :rows], request.audio_codes[:, :rows])
    continued = continue_prefill(model, prefix, request.input_ids[:, rows:], request.audio_codes[:, rows:])
    torch.testing.assert_close(continued.state.hidden, whole.state.hidden, **FLOAT32)
    filled = whole.cache.backbone_part.filled
    assert continued.cache.backbone_part.filled == filled and continued.cache.tower_part.filled == filled - 1
    assert torch.equal(continued.state.key_mask[:, :filled], whole.state.key_mask[:, :filled])
    for mine, theirs in zip(continued.cache.tower.layers, whole.cache.tower.layers):
        torch.testing.assert_close(mine.keys[:, :, : filled - 1], theirs.keys[:, :, : filled - 1], **FLOAT32)
    for mine, theirs in zip(continued.cache.backbone.layers, whole.cache.backbone.layers):
        if getattr(theirs, "keys", None) is not None:
            torch.testing.assert_close(mine.keys[:, :, :filled], theirs.keys[:, :, :filled], **FLOAT32)
        else:
            torch.testing.assert_close(mine.recurrent_states[0], theirs.recurrent_states[0], **FLOAT32)
            torch.testing.assert_close(mine.conv_states[0], theirs.conv_states[0], **FLOAT32)


def test_with_the_prefix_cache_a_request_gives_the_same_codes_alone_and_in_a_busy_batch(model):
    from transformers_drama3.serving.prefix_cache import PrefixCache

    def voiced(seed):
        request = job(seed=seed, prompt_seed=91)
        request.prefix = "voice"
        return request

    alone_cache = PrefixCache()
    (alone,) = drive(Drama3Engine(model, prefix_cache=alone_cache), {0: [voiced(5)]})
    cache = PrefixCache()
    busy = drive(Drama3Engine(model, prefix_cache=cache), {0: [voiced(6), job(7, 92)], 2: [voiced(5)]})
    assert torch.equal(busy[2].result(timeout=1).codes, alone.result(timeout=1).codes)
    assert cache.hits == 1 and cache.misses == 1


def test_requests_past_their_time_limit_end_as_timeouts_waiting_or_running(model):
    outcomes = {}
    engine = Drama3Engine(model, max_batch=1, on_finish=lambda handle, outcome: outcomes.setdefault(handle.id, outcome))
    running = engine.submit(job(seed=1, prompt_seed=1))
    engine.step()
    running.job.timeout = 0.0  # runs past its limit from now on
    waiting = engine.submit(SpeechJob(**{**vars(job(seed=2, prompt_seed=2)), "timeout": 0.0}))
    engine.step()
    assert outcomes[running.id] == "timeout" and running.result(timeout=1).kind == "timeout"
    engine.step()
    assert outcomes[waiting.id] == "timeout" and engine.idle


def test_a_request_cancelled_while_waiting_leaves_the_queue_without_taking_a_slot(model):
    engine = Drama3Engine(model, max_batch=1)
    first, second = engine.submit(job(seed=1, prompt_seed=1)), engine.submit(job(seed=2, prompt_seed=2))
    engine.step()
    second.cancel()
    engine.step()
    assert engine.queue_depth == 0 and second.result(timeout=1).kind == "cancelled"
    assert first.finished_at is None or isinstance(first.result(timeout=1), DoneEvent)


def test_slots_that_outgrow_the_pool_capacity_keep_their_codes(model):
    requests = [job(seed=20 + i, prompt_seed=40 + i, text_rows=3 + 4 * i) for i in range(3)]
    engine = Drama3Engine(model, capacity=8)
    capacities = []
    original = engine._grow
    engine._grow = lambda *capacity: original(*capacity) or capacities.append(engine._pool.capacity)
    handles = drive(engine, {0: requests[:1], 2: requests[1:]})
    assert capacities and capacities[-1] > 8  # grown while the requests ran
    for request, handle in zip(requests, handles):
        assert torch.equal(handle.result(timeout=1).codes, generate_alone(model, request)[0])


def test_the_engine_reports_an_overlong_take_where_the_model_sets_a_factor():
    from generation_helpers import SEMANTIC_START, script_main_tokens

    ids, codes = prompt(seed=2, text_rows=5, audio_rows=4)
    loop = SpeechJob(ids[None], codes[None], SamplingSettings(), seed=0, max_new_tokens=200)
    results = {}
    for factor in (None, 1.5):
        scripted = script_main_tokens(tiny_model(seed=0), [[SEMANTIC_START + 3] * 60])  # then eos, ~2x expected
        scripted.generation_config.overlong_factor = factor
        (handle,) = drive(Drama3Engine(scripted, max_batch=2), {0: [loop]})
        results[factor] = handle.result(timeout=1)
    assert results[None].finish_reason == "eos" and results[None].anomalies == []
    assert results[1.5].codes.shape[0] > 1.5 * results[1.5].expected_frames and results[1.5].anomalies == ["overlong"]
    scripted.generation_config.overlong_factor = 0.5
    with pytest.raises(ValueError, match="overlong_factor"):
        Drama3Engine(scripted)


# ---- the engine's state, not only its codes ------------------------------------------------------------


def drive_watching(engine, arrivals: dict, watched: SpeechJob):
    """`drive`, recording what `watched`'s item holds after every step it runs: the backbone output
    of its open row [dim], then its cache (every layer's keys and values or recurrent states).
    Returns (the handles by job, the records in step order)."""
    handles, seen, step = {}, [], 0
    while step <= max(arrivals) or not engine.idle:
        for request in arrivals.get(step, []):
            handles[id(request)] = engine.submit(request)
        engine.step()
        held = engine.state_of(handles[id(watched)]) if id(watched) in handles else None
        if held is not None:
            state, cache = held
            seen.append([state.hidden[0, 0].clone(), *cache])
        step += 1
    return handles, seen


def test_a_request_joining_a_reused_slot_beside_a_longer_request_has_the_states_it_has_alone(model):
    """A long request runs; a short one takes the second slot and leaves; a third joins that reused
    slot (its columns still hold the leaver's keys) beside the long one, whose rows run further:
    its backbone output after every step equals the one it has decoding alone (float64), so neither
    the leaver's keys nor its neighbour's longer rows reach it."""
    long = job(seed=1, prompt_seed=80, text_rows=9, audio_rows=8)
    long.max_new_tokens = 30
    short = job(seed=2, prompt_seed=81, audio_rows=2)
    short.max_new_tokens = 2
    joiner, alone = job(seed=11, prompt_seed=21), job(seed=11, prompt_seed=21)
    busy_handles, busy = drive_watching(Drama3Engine(model, max_batch=2), {0: [long, short], 4: [joiner]}, joiner)
    alone_handles, solo = drive_watching(Drama3Engine(model, max_batch=2), {0: [alone]}, alone)
    assert busy_handles[id(short)].finished_at is not None and len(busy) == len(solo) > 3
    for mine, theirs in zip(busy, solo):
        assert len(mine) == len(theirs)
        for held, reference in zip(mine, theirs):
            torch.testing.assert_close(held, reference, rtol=1e-9, atol=1e-9)
    codes = busy_handles[id(joiner)].result(timeout=1).codes
    assert torch.equal(codes, alone_handles[id(alone)].result(timeout=1).codes)
    assert torch.equal(codes, generate_alone(model, joiner)[0])


def test_the_engine_steps_a_request_as_the_decode_run_of_generate_steps_it_alone(model):
    """The backbone output of a request's open row after each engine step (other requests joining
    and leaving around it) equals the decode run `generate()` makes of its prompt alone."""
    from transformers_drama3.decoding.loop import DecodeRun
    from transformers_drama3.decoding.sampler import Drama3Sampler, item_keys, prompt_window

    request = job(seed=4, prompt_seed=83)
    arrivals = {0: [job(seed=5, prompt_seed=84, audio_rows=1), request], 2: [job(seed=6, prompt_seed=85)]}
    _, states = drive_watching(Drama3Engine(model, max_batch=3), arrivals, request)
    ids, codes = request.input_ids, request.audio_codes
    mask = torch.ones_like(ids)
    _, budget, _ = _budget_of(model, request)
    sampler = Drama3Sampler(request.settings, model.speech_token_ids(), prompt_window(ids, mask),
                            item_keys([request.seed], 1, ids.device))
    run = DecodeRun.prefilled(model, ids, codes, mask, sampler, torch.tensor([budget]))
    reference = [run.state.hidden[0, 0].clone() for index, _ in enumerate(run.steps()) if index]
    assert len(states) == len(reference) > 3
    for mine, theirs in zip(states, reference):
        torch.testing.assert_close(mine[0], theirs, rtol=1e-9, atol=1e-9)


def _budget_of(model, request: SpeechJob):
    from transformers_drama3.decoding.request import RequestOptions
    from transformers_drama3.decoding.request import resolve_request as _resolve_request

    options = RequestOptions(request.settings, max_new_tokens=request.max_new_tokens)
    resolved = _resolve_request(model, request.input_ids, torch.ones_like(request.input_ids), options)
    return resolved, int(resolved.budgets[0]), float(resolved.expected_frames[0])


# ---- the compiled step in batch-size buckets -----------------------------------------------------------


@pytest.mark.parametrize("dynamic", [False, None], ids=["fixed shapes", "automatic (the default config's)"])
def test_a_compiled_engine_steps_buckets_of_requests_and_gives_each_the_codes_it_has_alone(model, dynamic):
    """`compile_config` steps the running requests in batch-size buckets (3 running: 4 items, the
    fourth holding no request) through `torch.compile(fullgraph=True)` (dynamo's graph, run by its
    eager backend: a graph break fails the step) and gives each request the codes `generate()`
    gives it alone, as requests join and leave, with fixed shapes or torch's automatic dynamic
    shapes (the default config's: one graph then serves the buckets after the first). float64,
    with the batched-matmul experts (the per-expert loop of the eager experts reads which experts
    were chosen: no graph holds it)."""
    from transformers import CompileConfig

    traced = tiny_model(seed=0)
    traced.set_experts_implementation("batched_mm")
    traced = traced.double()
    requests = [job(seed=40 + i, prompt_seed=60 + i, audio_rows=1 + i) for i in range(5)]
    torch._dynamo.reset()
    engine = Drama3Engine(traced, max_batch=4, compile_config=CompileConfig(fullgraph=True, dynamic=dynamic,
                                                                             backend="eager", mode=None))
    stepped = []
    original = engine._compiled
    engine._compiled = lambda function, *args: stepped.append(
        (function, args[1].backbone_part.next_column.shape[0], args[1].capacity)) or original(function, *args)
    handles = drive(engine, {0: requests[:3], 2: requests[3:4], 5: requests[4:]})
    assert {items for _, items, _ in stepped} >= {2, 4}  # buckets, not the running count
    shapes = {(items, capacity) for _, items, capacity in stepped}
    # fixed shapes: a graph per bucket and capacity; automatic: the first shape's, one with the sizes
    # that changed symbolic, and batch 1's (torch specialises sizes of 1)
    assert graphs_of(engine._step_function) == (len(shapes) if dynamic is False else min(len(shapes), 3))
    assert {function for function, _, _ in stepped} == {engine._step_function}  # draw and feed in one graph
    assert engine._step_function is not Drama3Engine(model)._step_function  # the compiled function, not the plain one
    for request, handle in zip(requests, handles):
        result = handle.result(timeout=1)
        assert isinstance(result, DoneEvent), result
        assert torch.equal(result.codes, generate_alone(model, request)[0]), f"seed {request.seed}"


def test_a_compiled_engine_draws_min_p_requests_as_generate_does(model):
    """min_p in the compiled step (dynamo's graph, fullgraph: a graph break fails the step): two
    requests with different min_p give each the codes generate() gives it, which min_p changed."""
    from transformers import CompileConfig

    traced = tiny_model(seed=0)
    traced.set_experts_implementation("batched_mm")
    traced = traced.double()
    # temperature 0.5: the tiny model's candidates are near equally likely, and min_p keeps a few
    requests = [job(seed=150 + prompt_seed, prompt_seed=prompt_seed, temperature=0.5, top_p=1.0, min_p=min_p)
                for prompt_seed, min_p in ((80, 0.5), (82, 0.8))]
    torch._dynamo.reset()
    engine = Drama3Engine(traced, max_batch=2, compile_config=CompileConfig(fullgraph=True, dynamic=False,
                                                                             backend="eager", mode=None))
    handles = drive(engine, {0: requests})
    assert graphs_of(engine._step_function) >= 1
    codes = [handle.result(timeout=1).codes for handle in handles]
    for request, drawn in zip(requests, codes):
        assert torch.equal(drawn, generate_alone(model, request)[0]), f"min_p {request.settings.min_p}"
    for request, drawn in zip(requests, codes):
        unfiltered = replace(request, settings=replace(request.settings, min_p=0.0))
        assert not torch.equal(drawn, generate_alone(model, unfiltered)[0])  # min_p drew otherwise


def test_a_prefill_continued_from_a_prefix_copies_its_cache_not_its_model(model):
    """Each request continues from its own copy of the prefix's cache (the prefix stays as it was for
    the next request) and shares the model (copying it made a cached prefix slower than no cache)."""
    from transformers_drama3.serving.prefix_cache import continue_prefill, prefill_prefix

    request = job(seed=1, prompt_seed=93, audio_rows=6)
    prefix = prefill_prefix(model, request.input_ids[:, :7], request.audio_codes[:, :7])
    before = [tensor.clone() for tensor in prefix.run.cache.item_tensors(0, 7)]
    first = continue_prefill(model, prefix, request.input_ids[:, 7:], request.audio_codes[:, 7:])
    second = continue_prefill(model, prefix, request.input_ids[:, 7:], request.audio_codes[:, 7:])
    assert first.model is model and second.model is model and first.cache is not second.cache
    assert all(torch.equal(a, b) for a, b in zip(before, prefix.run.cache.item_tensors(0, 7)))
    assert prefix.run.cache.backbone_part.filled == 7
    torch.testing.assert_close(first.state.hidden, second.state.hidden, rtol=0, atol=0)


def test_a_voice_changed_under_a_cached_key_is_a_cache_miss(model):
    """Two prompts under one voice key whose system turns differ (the voice's clip changed): the
    second is prefilled from its own rows, not from the first's cached prefix."""
    from transformers_drama3.serving.prefix_cache import PrefixCache

    first, changed = job(seed=1, prompt_seed=94), job(seed=1, prompt_seed=95)
    first.prefix = changed.prefix = "voice"
    cache = PrefixCache()
    cache.prefill(model, first)
    run = cache.prefill(model, changed)
    assert cache.misses == 2 and cache.hits == 0
    alone = prefill_alone(model, changed)
    torch.testing.assert_close(run.state.hidden, alone.state.hidden, **FLOAT32)


def test_line_by_line_prompts_draw_their_boundaries_in_the_engine_as_generate_draws_them():
    """An engine given `<|audio_separator|>` speaks line-by-line prompts as `generate()` does (the
    same codes and line boundaries, greedy and seeded), beside a prompt of the published layout,
    whose codes stay those of `generate()` without separators."""
    from generation_helpers import SEPARATOR, line_model, line_prompt

    lines = line_model(seed=0)
    lines.set_experts_implementation("eager")
    lines = lines.double()
    jobs = [SpeechJob(*(tensor[None] for tensor in line_prompt(2)), SamplingSettings(do_sample=False), seed=1, max_new_tokens=12),
            SpeechJob(*(tensor[None] for tensor in line_prompt(3, lines=2)), SamplingSettings(temperature=1.5, top_p=1.0),
                      seed=2, max_new_tokens=12),
            job(seed=3, prompt_seed=4)]
    handles = drive(Drama3Engine(lines, max_batch=4, audio_separator_token_id=SEPARATOR), {0: jobs[:2], 1: jobs[2:]})
    results = [handle.result(timeout=1) for handle in handles]
    for request, result in zip(jobs, results):
        settings = request.settings
        alone = lines.generate(request.input_ids, request.audio_codes, seed=request.seed, max_new_tokens=request.max_new_tokens,
                               do_sample=settings.do_sample, temperature=settings.temperature, top_p=settings.top_p,
                               audio_separator_token_id=SEPARATOR, return_dict_in_generate=True)
        assert torch.equal(result.codes, alone.audio_codes[0, : int(alone.lengths[0])])
        assert result.line_boundaries == alone.line_boundaries[0]
    assert results[0].line_boundaries == [2, 7] and results[2].line_boundaries == []


def test_an_engine_refuses_a_separator_that_is_not_a_text_token(model):
    with pytest.raises(ValueError, match="audio_separator_token_id=2 is not a text token"):
        Drama3Engine(model, audio_separator_token_id=model.config.eos_token_id)


# ---- a pool grown by a long prompt (chunked prefill: tests/test_serving_chunked_prefill.py) ---------------


def test_the_pool_a_long_prompt_grew_is_given_back_when_no_request_runs(model):
    """A prompt longer than the pool's capacity grows every slot's columns; once no request runs the
    grown pool is dropped (its memory returned) and the next request gets the starting capacity."""
    ids, codes = prompt(seed=72, tail_rows=40)
    engine = Drama3Engine(model, max_batch=2, capacity=32)
    long = engine.submit(SpeechJob(ids[None], codes[None], SamplingSettings(), seed=1, max_new_tokens=MAX_FRAMES))
    engine.step()
    assert engine._pool.capacity > 32
    while not engine.idle:
        engine.step()
    assert engine._pool is None and isinstance(long.result(timeout=1), DoneEvent)
    short = engine.submit(job(seed=2, prompt_seed=73))
    engine.step()
    assert engine._pool.capacity == 32
    while not engine.idle:
        engine.step()
    assert isinstance(short.result(timeout=1), DoneEvent)


def test_the_heap_is_trimmed_again_once_the_engine_has_been_idle_a_moment(model, monkeypatch):
    """Dropping a grown pool trims the heap at once, and once more after IDLE_TRIM_DELAY idle: what
    the requests' callers freed after the last step (the HTTP layer's buffers) goes back too (a
    server kept ~half its growth without the second trim). An engine that grew nothing never trims."""
    import time

    from transformers_drama3.serving import engine as engine_module

    trims = []
    monkeypatch.setattr(engine_module, "return_freed_memory", lambda: trims.append(time.monotonic()))
    ids, codes = prompt(seed=72, tail_rows=40)
    engine = Drama3Engine(model, max_batch=2, capacity=32)
    engine.start()
    try:
        short = engine.submit(job(seed=2, prompt_seed=73))
        assert isinstance(short.result(timeout=60), DoneEvent)
        time.sleep(3 * engine_module.IDLE_TRIM_DELAY)
        assert trims == []  # the pool never grew: nothing to give back
        long = engine.submit(SpeechJob(ids[None], codes[None], SamplingSettings(), seed=1, max_new_tokens=MAX_FRAMES))
        assert isinstance(long.result(timeout=60), DoneEvent)
        deadline = time.monotonic() + 10
        while len(trims) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3 * engine_module.IDLE_TRIM_DELAY)
        assert len(trims) == 2, trims  # at the drop, and once when idle: not again and again
        assert trims[1] - trims[0] >= engine_module.IDLE_TRIM_DELAY
    finally:
        engine.stop()


def test_a_step_is_read_on_the_host_from_one_copy_with_its_values():
    from transformers_drama3.decoding.loop import PendingStep
    from transformers_drama3.decoding.step import StepOutput

    generator = torch.Generator().manual_seed(3)
    flags = [torch.rand(5, generator=generator) < 0.5 for _ in range(5)]
    output = StepOutput(torch.randint(0, 5000, (5,), generator=generator), torch.randint(0, 4096, (5, 10), generator=generator),
                        *flags[:4])
    step, active = PendingStep(7, output, flags[4]).wait()
    assert step.step == 7
    assert torch.equal(step.main_ids, output.main_ids) and torch.equal(step.frames, output.frames)
    for name, expected in zip(("produced", "ended", "eos", "boundary"), flags):
        value = getattr(step, name)
        assert value.dtype == torch.bool and torch.equal(value, expected), name
    assert active.dtype == torch.bool and torch.equal(active, flags[4])


def test_a_prompt_prefilled_alone_builds_no_autograd_graph(model):
    """`prefill_alone` runs without gradients even when its caller records them (it is public, and
    a custom `prefill` may call it): its state holds no graph of the prompt."""
    run = prefill_alone(model, job(seed=1, prompt_seed=94))
    assert torch.is_grad_enabled() and any(parameter.requires_grad for parameter in model.parameters())
    assert run.state.hidden.grad_fn is None and not run.state.hidden.requires_grad


def test_the_engine_queues_each_step_whole_and_reads_it_after(model, monkeypatch):
    """Every step is one call of the step function (draw, then the feed of every item's row) before
    the scheduler reads it on the host; requests that end with a step had their rows fed for
    nothing and still get their codes alone, beside requests that go on. (On CUDA the next step is
    queued before the last is read: `tests/test_serving_engine_ahead.py`.)"""
    engine = Drama3Engine(model, max_batch=3)
    events = recorded_step_order(engine, monkeypatch, functions=("step_function",))
    jobs = [job(seed=40 + i, prompt_seed=50 + i, text_rows=3 + 2 * i, temperature=1.2, top_p=0.95) for i in range(3)]
    jobs[0] = SpeechJob(jobs[0].input_ids, jobs[0].audio_codes, jobs[0].settings, seed=40, max_new_tokens=3)
    handles = drive(engine, {0: jobs[:2], 2: jobs[2:]})
    assert engine.stats.steps > 4 and events == ["step_function", "read"] * engine.stats.steps
    lengths = []
    for handle, request in zip(handles, jobs):
        result = handle.result(timeout=1)
        expected, reason = generate_alone(model, request)
        assert torch.equal(result.codes, expected) and result.finish_reason == reason
        lengths.append(result.codes.shape[0])
    assert len(set(lengths)) > 1  # they ended at different steps
