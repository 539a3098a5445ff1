"""`DecodeRun.steps_ahead()`: each step's `feed` queued before the host reads what its `draw`
made (on a GPU the device feeds the row while the host reads the step), against `steps()`, which
feeds a row only once the host has read that some item still speaks (the reference). Both read a
step on the host from one packed copy (`PendingStep`)."""

import itertools

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import left_pad, prompt, recorded_step_order, tiny_model
from transformers_drama3.decoding.loop import DecodeRun, PendingStep, RunFedAhead
from transformers_drama3.decoding.request import make_sampler, resolve_request
from transformers_drama3.decoding.sampler import SamplingSettings
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


def batch_run(model, settings: SamplingSettings, seed, compile_config=None) -> DecodeRun:
    """Three left-padded prompts, prefilled, with budgets of 5, 12 and 30 frames: the items end at
    different steps."""
    ids, codes, mask = left_pad([prompt(1), prompt(2, audio_rows=1), prompt(3)])
    request = resolve_request(model, settings, ids, mask, max(BUDGETS), 1.0)
    sampler = make_sampler(model, request, ids, mask, seed)
    return DecodeRun.prefilled(model, ids, codes, mask, sampler, torch.tensor(BUDGETS), compile_config=compile_config)


def assert_same_runs(model, settings, seed, compile_config=None) -> tuple[DecodeRun, DecodeRun, list]:
    """Step one run by `steps()` and a twin by `steps_ahead()`: the same steps, and at every yield
    the same state. Returns both runs and the steps."""
    plain, ahead = batch_run(model, settings, seed, compile_config), batch_run(model, settings, seed, compile_config)
    steps = []
    for first, second in itertools.zip_longest(plain.steps(), ahead.steps_ahead()):
        assert first is not None and second is not None, "one run made more steps than the other"
        assert first.step == second.step
        for name in ("main_ids", "frames", "produced", "ended", "eos", "boundary"):
            assert torch.equal(getattr(first, name), getattr(second, name)), (first.step, name)
            assert getattr(second, name).device.type == "cpu"
        torch.testing.assert_close(ahead.state.hidden, plain.state.hidden)
        for name in ("key_mask", "position", "active", "produced"):
            assert torch.equal(getattr(ahead.state, name), getattr(plain.state, name)), (first.step, name)
        steps.append(first)
    return plain, ahead, steps


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_steps_ahead_make_the_steps_and_states_that_steps_make(model, case):
    plain, ahead, steps = assert_same_runs(model, *CASES[case])
    assert steps[-1].ended.any() and not any(step.ended.all() for step in steps[:-1])
    assert len({step.step for step in steps if step.ended.any()}) >= 2  # some items ended before the last step
    ended_on_eos = bool(steps[-1].eos.any())
    assert ended_on_eos == (case == "seeded, last item ends on eos")
    # where the caches stand: the same counters, the same keys in every filled column
    for mine, theirs in zip(ahead.cache.parts, plain.cache.parts):
        assert mine.filled == theirs.filled and torch.equal(mine.next_column, theirs.next_column)
    filled = plain.cache.backbone_part.filled
    linear_states_differ = False
    for mine, theirs in zip(ahead.cache.backbone.layers, plain.cache.backbone.layers, strict=True):
        if hasattr(theirs, "part"):
            torch.testing.assert_close(mine.keys[:, :, :filled], theirs.keys[:, :, :filled])
        else:
            linear_states_differ |= not torch.allclose(mine.recurrent_states[0], theirs.recurrent_states[0])
    # ... but the Gated DeltaNet states took the row fed past the end: why the run cannot go on
    assert linear_states_differ


@torch.no_grad()
def test_compiled_steps_ahead_make_the_steps_that_steps_make(model):
    torch._dynamo.reset()
    compiled = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager", mode=None)
    assert_same_runs(model, *CASES["seeded, last item ends on eos"], compile_config=compiled)


@torch.no_grad()
def test_a_run_stepped_ahead_refuses_to_be_continued(model):
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
def test_steps_ahead_queue_each_feed_before_reading_its_draw(model, monkeypatch):
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    events = recorded_step_order(run, monkeypatch)
    steps = len(list(run.steps_ahead()))
    assert events == ["draw", "feed", "read"] * steps


@torch.no_grad()
def test_steps_read_each_draw_before_feeding_its_row(model, monkeypatch):
    run = batch_run(model, *CASES["greedy, last item ends on its budget"])
    events = recorded_step_order(run, monkeypatch)
    steps = len(list(run.steps()))
    assert events == ["draw", "read", "feed"] * (steps - 1) + ["draw", "read"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_on_cuda_steps_ahead_read_each_step_through_pinned_memory_and_make_the_steps_of_steps():
    model = tiny_model(seed=0).cuda()
    ids, codes, mask = (tensor.cuda() for tensor in left_pad([prompt(1), prompt(2, audio_rows=1), prompt(3)]))
    settings, seed = CASES["seeded, last item ends on eos"]
    runs = []
    for _ in range(2):
        request = resolve_request(model, settings, ids, mask, max(BUDGETS), 1.0)
        sampler = make_sampler(model, request, ids, mask, seed)
        runs.append(DecodeRun.prefilled(model, ids, codes, mask, sampler, torch.tensor(BUDGETS, device="cuda")))
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
