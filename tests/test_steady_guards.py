"""Dynamo's guards on the compiled step, checked in full only where a run may have changed
(`decoding.steady_guards`): what the skipped guards miss is caught at the next full check, a
tensor that fits no graph compiles one, a run and a serving batch check in full where they start,
and the prompt's open row gives the first step the graph of the next ones (one per batch size)."""

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import prompt, tiny_model
from transformers_drama3.decoding.loop import DecodeRun, compiled_functions
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.steady_guards import CHECK_EVERY, GuardsChangedInRun, SteadyGuards, graphs_of
from transformers_drama3.serving.engine import DoneEvent, Drama3Engine, SpeechJob

EAGER_GRAPHS = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)


class Holder:
    flag = True


def compiled(function):
    return torch.compile(function, backend="eager", fullgraph=True, dynamic=False)


def scaled_by_flag(x, holder):
    return x * 2 if holder.flag else x * 3


def test_a_python_value_changed_between_checks_is_caught_at_the_next_full_check():
    function, guards, holder, x = compiled(scaled_by_flag), SteadyGuards(), Holder(), torch.ones(2)
    assert guards(function, x, holder).tolist() == [2, 2] and guards.full_checks == 1
    holder.flag = False
    for _ in range(CHECK_EVERY - 1):  # the skipped guards do not watch the flag: the graph made for True runs
        assert guards(function, x, holder).tolist() == [2, 2]
    assert guards.full_checks == 1
    with pytest.raises(GuardsChangedInRun, match=f"scaled_by_flag: call {CHECK_EVERY + 1} of this run needed a new graph"):
        guards(function, x, holder)


def shifted_by_flag(x, holder):
    return x + 1 if holder.flag else x - 1


def test_after_a_reset_the_first_call_checks_every_guard():
    function, guards, holder, x = compiled(shifted_by_flag), SteadyGuards(), Holder(), torch.zeros(2)
    assert guards(function, x, holder).tolist() == [1, 1]
    assert guards(function, x, holder).tolist() == [1, 1]
    holder.flag = False
    guards.reset()
    assert guards(function, x, holder).tolist() == [-1, -1]  # a new graph, compiled at a full check: no error
    assert guards.full_checks == 2 and graphs_of(function) == 2


def doubled(x):
    return x * 2


def test_a_tensor_that_fits_no_graph_compiles_one_instead_of_running_a_stale_one():
    function, guards = compiled(doubled), SteadyGuards()
    assert guards(function, torch.ones(2)).tolist() == [2, 2]
    assert guards(function, torch.ones(2)).tolist() == [2, 2]
    assert guards(function, torch.ones(3)).tolist() == [2, 2, 2]  # dynamo refuses the skipped call; checked in full
    assert guards(function, torch.ones(2, dtype=torch.float64)).dtype == torch.float64
    assert guards.full_checks == 3 and graphs_of(function) == 3


# ---- the decode run --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def opened(model, compile_config, budget):
    ids, codes = prompt(4)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    options = RequestOptions(SamplingSettings(temperature=1.5, top_p=1.0), max_new_tokens=budget, expected_seconds=10.0)
    request = resolve_request(model, ids, mask, options)
    sampler = make_sampler(model, request.reseeded(25))  # a take that runs to its budget
    return DecodeRun.prefilled(model, ids, codes, mask, sampler, request.budgets, compile_config=compile_config)


@torch.no_grad()
def test_a_compiled_run_past_several_full_checks_draws_the_eager_frames_from_one_graph_per_function(model):
    """Batch 1, more than 2 * CHECK_EVERY steps: the same frames as the eager run; the prompt's open
    row has the strides of a fed row, so the first step adds no graph of its own (one draw and one
    feed graph for this model and batch); every guard runs on each function's first call and
    every CHECK_EVERY-th."""
    budget = 2 * CHECK_EVERY + 8
    draw, feed, _ = compiled_functions(EAGER_GRAPHS)
    graphs = graphs_of(draw), graphs_of(feed)
    eager = [step.frames for step in opened(model, None, budget).steps()]
    run = opened(model, EAGER_GRAPHS, budget)
    through_graphs = [step.frames for step in run.steps()]
    assert len(eager) > 2 * CHECK_EVERY, "the take ended early: pick a prompt or seed that speaks longer"
    assert [frames.tolist() for frames in through_graphs] == [frames.tolist() for frames in eager]
    assert (graphs_of(draw), graphs_of(feed)) == (graphs[0] + 1, graphs[1] + 1)
    draws, feeds = len(eager), len(eager) - 1  # the last step ends the take: no row fed after it
    assert run._guards.full_checks == -(-draws // CHECK_EVERY) + -(-feeds // CHECK_EVERY)


# ---- the serving engine ----------------------------------------------------------------------------------


def test_a_request_joining_a_compiled_batch_of_the_same_size_is_checked_in_full(model):
    """A sampler's settings are Python values its graph holds, which the skipped guards do not
    watch: a request that joins a bucket that keeps its size (3 running of 4 items, then 4) with
    other settings gets the codes it gets alone, because a new batch runs every guard on its first
    step."""
    engine_model = tiny_model(seed=0)
    engine_model.set_experts_implementation("batched_mm")
    engine_model = engine_model.double()

    def job(seed, prompt_seed, **settings):
        ids, codes = prompt(seed=prompt_seed)
        return SpeechJob(ids[None], codes[None], SamplingSettings(**settings), seed=seed, max_new_tokens=12)

    torch._dynamo.reset()
    engine = Drama3Engine(engine_model, max_batch=4, compile_config=EAGER_GRAPHS)
    first = [engine.submit(job(20 + i, 30 + i)) for i in range(3)]
    for _ in range(3):
        engine.step()
    assert len(engine._slots) == 3 and engine._items() == 4
    checks = engine._guards.full_checks
    joining_job = job(9, 39, do_sample=False)
    joining = engine.submit(joining_job)
    while len(engine._slots) < 4:
        engine.step()
    engine.step()
    assert engine._items() == 4 and engine._guards.full_checks > checks
    while not engine.idle:
        engine.step()
    expected = engine_model.generate(joining_job.input_ids, joining_job.audio_codes, seed=9, max_new_tokens=12,
                                     do_sample=False, return_dict_in_generate=True)
    result = joining.result(timeout=1)
    assert isinstance(result, DoneEvent)
    assert torch.equal(result.codes, expected.audio_codes[0, : int(expected.lengths[0])])
    for handle in first:
        assert isinstance(handle.result(timeout=1), DoneEvent)


def test_without_torchs_cache_entry_helper_the_graphs_compiled_in_the_process_are_counted(monkeypatch):
    import torch._dynamo.eval_frame as eval_frame

    function = compiled(doubled)
    function(torch.ones(5))
    assert graphs_of(function) >= 1
    monkeypatch.delattr(eval_frame, "_debug_get_cache_entry_list")
    before = graphs_of(function)
    assert before == torch._dynamo.utils.counters["stats"]["unique_graphs"]
    function(torch.ones(5, 5))
    assert graphs_of(function) == before + 1


def test_a_full_check_waits_for_a_skipped_guard_call_of_another_thread():
    """torch's stance is process-wide: the compiled prefill's full check (`checked_call`) and the
    step's calls take one lock, so one never runs inside the other's skipped-guard window."""
    import threading

    from transformers_drama3.decoding import steady_guards

    function, finished = compiled(doubled), threading.Event()
    function(torch.ones(7))
    with steady_guards._LOCK:  # as a step's skipped-guard call holds it
        thread = threading.Thread(target=lambda: steady_guards.checked_call(function, torch.ones(7)) is not None
                                  and finished.set())
        thread.start()
        assert not finished.wait(0.3)
    thread.join(timeout=30)
    assert finished.is_set()
