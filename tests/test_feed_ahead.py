"""`DecodeRun.steps_ahead()`: each step made whole by one call of `step.step` (draw, then feed of
its row), and on a GPU the next one queued before the host reads the last (`runs_ahead`; forced
here, "queued ahead", to test that order on the CPU), against `steps()`, which feeds a row only
once the host has read that some item still speaks (the reference). Both read a step on the host
from one packed copy (`PendingStep`). The serving engine's order (feed queued before the read)
is tested with the engine."""

import itertools

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import left_pad, prompt, recorded_step_order, tiny_model
from transformers_drama3.decoding import loop
from transformers_drama3.decoding.loop import DecodeRun, PendingStep, RunFedAhead, compiled_functions
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.steady_guards import graphs_of
from transformers_drama3.decoding.step import StepOutput

BUDGETS = [5, 12, 30]
CASES = {
    # how the last step of the run ends, for these prompts and budgets on `tiny_model(seed=0)`
    "greedy, last item ends on its budget": (SamplingSettings(do_sample=False), None),
    "flat, last item ends on its budget": (SamplingSettings(temperature=1.5, top_p=1.0), 5),
    "seeded, last item ends on eos": (SamplingSettings(), 0),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(params=["queued ahead", "one at a time"])
def queued_ahead(request, monkeypatch) -> bool:
    """Whether `steps_ahead` queues each step before reading the last, as on CUDA (forced here), or
    makes them one at a time, as on the CPU."""
    ahead = request.param == "queued ahead"
    monkeypatch.setattr(loop, "runs_ahead", lambda device: ahead)
    return ahead


def batch_run(model, settings: SamplingSettings, seed, compile_config=None) -> DecodeRun:
    """Three left-padded prompts, prefilled, with budgets of 5, 12 and 30 frames: the items end at
    different steps (on the model's device)."""
    ids, codes, mask = (tensor.to(model.device) for tensor in left_pad([prompt(1), prompt(2, audio_rows=1), prompt(3)]))
    request = resolve_request(model, ids, mask, RequestOptions(settings, seed, max(BUDGETS), expected_seconds=1.0))
    sampler = make_sampler(model, request)
    return DecodeRun.prefilled(model, ids, codes, mask, sampler, torch.tensor(BUDGETS, device=model.device),
                               compile_config=compile_config)


STATE = ("hidden", "key_mask", "position", "active", "produced")


def assert_same_runs(model, settings, seed, queued_ahead: bool, compile_config=None) -> tuple[DecodeRun, DecodeRun, list]:
    """Step one run by `steps()` and a twin by `steps_ahead()`: the same steps, and the same states.
    At the yield of step k the run stepped in order stands after its draw k (its open row: the row
    fed at step k - 1), the other after its step k (draw and feed), or k + 1 when queued ahead.
    Returns both runs and the steps."""
    plain, ahead = batch_run(model, settings, seed, compile_config), batch_run(model, settings, seed, compile_config)
    steps, plain_states, ahead_states = [], [], []
    for first, second in itertools.zip_longest(plain.steps(), ahead.steps_ahead()):
        assert first is not None and second is not None, "one run made more steps than the other"
        assert first.step == second.step
        for name in ("main_ids", "frames", "produced", "ended", "eos", "boundary"):
            assert torch.equal(getattr(first, name), getattr(second, name)), (first.step, name)
            assert getattr(second, name).device.type == "cpu"
        steps.append(first)
        plain_states.append({name: getattr(plain.state, name).clone() for name in STATE})
        ahead_states.append({name: getattr(ahead.state, name).clone() for name in STATE})
    lead = 2 if queued_ahead else 1
    for index, state in enumerate(ahead_states[:-lead]):
        fed, drawn = plain_states[index + lead], plain_states[index + lead - 1]
        torch.testing.assert_close(state["hidden"], fed["hidden"])
        assert torch.equal(state["key_mask"], fed["key_mask"]) and torch.equal(state["position"], fed["position"])
        assert torch.equal(state["active"], drawn["active"]) and torch.equal(state["produced"], drawn["produced"])
    assert len(ahead_states) > 4
    return plain, ahead, steps


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_steps_ahead_make_the_steps_and_states_that_steps_make(model, case, queued_ahead):
    plain, ahead, steps = assert_same_runs(model, *CASES[case], queued_ahead)
    assert steps[-1].ended.any() and not any(step.ended.all() for step in steps[:-1])
    assert len({step.step for step in steps if step.ended.any()}) >= 2  # some items ended before the last step
    ended_on_eos = bool(steps[-1].eos.any())
    assert ended_on_eos == (case == "seeded, last item ends on eos")
    # the run stepped ahead fed the last step's row (and, queued ahead, made one step more)
    assert ahead.cache.backbone_part.filled == plain.cache.backbone_part.filled + (2 if queued_ahead else 1)
    filled = plain.cache.backbone_part.filled
    linear_states_differ = False
    for mine, theirs in zip(ahead.cache.backbone.layers, plain.cache.backbone.layers, strict=True):
        if hasattr(theirs, "part"):
            torch.testing.assert_close(mine.keys[:, :, :filled], theirs.keys[:, :, :filled])
            torch.testing.assert_close(mine.values[:, :, :filled], theirs.values[:, :, :filled])
        else:
            linear_states_differ |= not torch.allclose(mine.recurrent_states[0], theirs.recurrent_states[0])
    tower_filled = plain.cache.tower_part.filled
    for mine, theirs in zip(ahead.cache.tower.layers, plain.cache.tower.layers, strict=True):
        torch.testing.assert_close(mine.keys[:, :, :tower_filled], theirs.keys[:, :, :tower_filled])
    # ... but the Gated DeltaNet states took the rows fed past the end: why the run cannot go on
    assert linear_states_differ


@torch.no_grad()
def test_compiled_steps_ahead_make_the_steps_that_steps_make_from_one_graph_per_step(model, queued_ahead):
    torch._dynamo.reset()
    compiled = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    functions = compiled_functions(compiled)
    assert_same_runs(model, *CASES["seeded, last item ends on eos"], queued_ahead, compile_config=compiled)
    assert graphs_of(functions.step) == 1  # draw and feed in one graph, for every step of the run


@torch.no_grad()
def test_a_run_stepped_ahead_refuses_to_be_continued(model, queued_ahead):
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    last = list(run.steps_ahead())[-1]
    ids, codes = prompt(1)
    continuations = {
        "extend": lambda: run.extend(ids[None].expand(3, -1), codes[None].expand(3, -1, -1)),
        "feed_last_frame": lambda: run.feed_last_frame(last),
        "next_turn": lambda: run.next_turn(run.sampler, torch.tensor(BUDGETS)),
        "steps": lambda: next(run.steps()),
        "steps_ahead": lambda: next(run.steps_ahead()),
        "copy": run.copy,
    }
    for name, continuation in continuations.items():
        with pytest.raises(RunFedAhead, match="steps_ahead"):
            continuation()
            pytest.fail(f"{name} continued a run stepped ahead")


@torch.no_grad()
def test_a_run_stepped_in_order_can_still_be_continued(model):
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    list(run.steps())
    run.next_turn(run.sampler, torch.tensor([2, 2, 2]))
    assert len(list(run.steps())) == 2


@torch.no_grad()
def test_steps_ahead_queue_each_step_before_reading_the_last_where_the_device_runs_ahead(model, monkeypatch, queued_ahead):
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    events = recorded_step_order(run, monkeypatch, functions=("draw", "feed", "step"))
    steps = len(list(run.steps_ahead()))
    if queued_ahead:
        assert events == ["step"] + ["step", "read"] * steps  # the last "step" is made past the end
    else:
        assert events == ["step", "read"] * steps


def test_only_cuda_runs_ahead_of_the_host():
    assert loop.runs_ahead(torch.device("cuda")) and not loop.runs_ahead(torch.device("cpu"))


@torch.no_grad()
def test_steps_read_each_draw_before_feeding_its_row(model, monkeypatch):
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    events = recorded_step_order(run, monkeypatch, functions=("draw", "feed", "step"))
    steps = len(list(run.steps()))
    assert events == ["draw", "read", "feed"] * (steps - 1) + ["draw", "read"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_on_cuda_steps_ahead_read_each_step_through_pinned_memory_and_make_the_steps_of_steps():
    model = tiny_model(seed=0).cuda()
    runs = [batch_run(model, *CASES["seeded, last item ends on eos"]) for _ in range(2)]
    plain, ahead = list(runs[0].steps()), list(runs[1].steps_ahead())
    assert [step.frames.tolist() for step in plain] == [step.frames.tolist() for step in ahead]
    generator = torch.Generator().manual_seed(1)
    flags = [(torch.rand(4, generator=generator) < 0.5).cuda() for _ in range(5)]
    output = StepOutput(torch.randint(0, 5000, (4,), generator=generator).cuda(),
                        torch.randint(0, 4096, (4, 10), generator=generator).cuda(), *flags[:4])
    pending = PendingStep(3, output, flags[4])
    assert pending._host.is_pinned()
    step, active = pending.wait()
    assert torch.equal(step.frames, output.frames.cpu()) and torch.equal(active, flags[4].cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_on_cuda_a_run_stepped_in_order_goes_on_from_its_last_step_read_on_the_host():
    """The text stream's continuation: the last frame of a take that used its budget, read on the
    host, is fed on the model's device, and the next turn draws."""
    model = tiny_model(seed=0).cuda()
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    last = list(run.steps())[-1]
    assert last.frames.device.type == "cpu"
    run.feed_last_frame(last)
    run.next_turn(run.sampler, torch.tensor([2, 2, 2]))
    assert len(list(run.steps())) == 2
