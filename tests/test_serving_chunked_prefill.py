"""Chunked prefill in the serving engine (`serving.chunked_prefill`): long prompts never hold a
running request for more than one decode step and one turn of `prefill_chunk` rows, counted in
rows and steps (not seconds); prefill takes at most `prefill_share` of the scheduler's time while
requests run; a prompt's pieces depend only on the prompt, so its prefilled state is the same
bitwise alone, beside others, and with the voice-prefix cache warm, cold or off; short prompts
go first and the oldest prompt is never starved; every request keeps the codes it has alone."""

import math

import pytest
import torch

from generation_helpers import SEMANTIC_START, prompt, tiny_model
from test_serving_engine import MAX_FRAMES, generate_alone, job, model  # noqa: F401  (the float64 model fixture)
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.serving.chunked_prefill import OLDEST_EVERY, check_prefill_settings, piece_end
from transformers_drama3.serving.engine import DoneEvent, Drama3Engine, SpeechJob
from transformers_drama3.serving.prefix_cache import PrefixCache

SYSTEM_ROWS = 35  # a voice turn of 5 text rows and 30 frames: a long voice prefix


def voiced(seed: int, turn_seed: int, tail_rows: int = 30, voice_seed: int = 7, max_new_tokens: int = MAX_FRAMES) -> SpeechJob:
    """A prompt of voice `voice_seed` (its system turn: SYSTEM_ROWS rows, the same for every turn of
    that voice) with a turn to speak of `tail_rows` text rows drawn from `turn_seed`."""
    ids, codes = prompt(seed=voice_seed, text_rows=5, audio_rows=SYSTEM_ROWS - 5, tail_rows=tail_rows)
    generator = torch.Generator().manual_seed(turn_seed)
    ids[SYSTEM_ROWS + 2 : SYSTEM_ROWS + 2 + tail_rows] = torch.randint(4, SEMANTIC_START, (tail_rows,), generator=generator)
    return SpeechJob(ids[None], codes[None], SamplingSettings(temperature=1.1, top_p=0.95), seed=seed,
                     max_new_tokens=max_new_tokens, prefix=f"voice{voice_seed}")


class Work:
    """What the engine computes, in order: ("rows", n) for each prefill forward of n rows, ("step",)
    for each decode step; `clock()` counts it (a row costs 1, a step `step_cost`), so time-based
    scheduling is tested deterministically."""

    def __init__(self, engine, model, monkeypatch, step_cost: float = 1.0):
        self.events, self.elapsed = [], 0.0
        for name, rows_of in (("prefill", lambda args: args[0].shape[1]), ("extend", lambda args: args[3].shape[1])):
            monkeypatch.setattr(model, name, self._counted(getattr(model, name), rows_of))
        step = engine._step_function

        def stepped(*args):
            self.events.append(("step",))
            self.elapsed += step_cost
            return step(*args)

        engine._step_function = stepped
        engine._share.clock = lambda: self.elapsed

    def _counted(self, function, rows_of):
        def call(*args, **kwargs):
            rows = rows_of(args)
            self.events.append(("rows", rows))
            self.elapsed += rows
            return function(*args, **kwargs)
        return call

    def rows_between_steps(self) -> list[int]:
        """Rows prefilled between consecutive decode steps (the first entry: before the first step
        recorded)."""
        runs, rows = [], 0
        for event in self.events:
            if event[0] == "step":
                runs.append(rows)
                rows = 0
            else:
                rows += event[1]
        return runs

    def turns(self) -> list[tuple[int, int]]:
        """(rows of a prefill turn, decode steps after it before the next turn) for each turn."""
        turns = []
        for event in self.events:
            if event[0] == "rows":
                if turns and turns[-1][1] == 0:
                    turns[-1] = (turns[-1][0] + event[1], 0)
                else:
                    turns.append((event[1], 0))
            elif turns:
                turns[-1] = (turns[-1][0], turns[-1][1] + 1)
        return turns


def test_pieces_are_cut_every_chunk_rows_and_at_the_end_of_the_system_turn():
    def pieces(rows, boundary, chunk):
        ends, filled = [], 0
        while filled < rows:
            filled = piece_end(filled, rows, boundary, chunk)
            ends.append(filled)
        return ends

    assert pieces(30, 11, 4) == [4, 8, 11, 15, 19, 23, 27, 30]
    assert pieces(30, 0, 8) == [8, 16, 24, 30]
    assert pieces(9, 8, 8) == [8, 9]
    assert pieces(5, 0, 2) == [2, 4, 5]
    assert pieces(3, 1, 8) == [2, 3]  # a first piece holds at least 2 rows
    with pytest.raises(ValueError, match="all prefilled"):
        piece_end(30, 30, 11, 4)


@pytest.mark.parametrize("chunk, share, message", [
    (1, 0.5, "prefill_chunk=1; expected at least 2 rows"),
    (2.5, 0.5, "prefill_chunk=2.5"),
    (8, 0.0, "prefill_share=0.0; expected a fraction in \\(0, 1\\]"),
    (8, 1.01, "prefill_share=1.01"),
    (8, float("nan"), "prefill_share=nan"),
    (8, True, "prefill_share=True"),
])
def test_a_prefill_chunk_under_two_rows_or_a_share_outside_0_1_is_refused(model, chunk, share, message):
    with pytest.raises(ValueError, match=message):
        Drama3Engine(model, prefill_chunk=chunk, prefill_share=share)
    check_prefill_settings(2, 1.0)  # the limits themselves are accepted


def test_long_prompts_hold_a_running_request_one_turn_of_chunk_rows_at_most_and_change_no_codes(model, monkeypatch):
    """Three long prompts of one voice (a 35-row system turn, not cached yet) arrive together beside
    a running request: between any two of its steps at most `prefill_chunk` rows are prefilled (the
    voice's system turn too, prefilled a piece at a time on the cache miss), it draws a frame at
    every step, the prompts after the first start from the cached system turn, and every request
    gets the codes `generate()` gives it alone (float64: seeded draws compare exactly)."""
    chunk = 8
    cache = PrefixCache()
    engine = Drama3Engine(model, max_batch=4, prefill_chunk=chunk, prefill_share=1.0, prefix_cache=cache)
    running = job(seed=3, prompt_seed=70, text_rows=12)
    running.max_new_tokens = 24  # it outlasts the three prefills
    longs = [voiced(seed=10 + i, turn_seed=20 + i, tail_rows=6 + 2 * i) for i in range(3)]
    first = engine.submit(running)
    while engine.state_of(first) is None:
        engine.step()
    work, rows_before = Work(engine, model, monkeypatch), engine.stats.prefill_rows
    handles = [engine.submit(request) for request in longs]
    produced = []
    while any(handle.finished_at is None and engine.state_of(handle) is None for handle in handles):
        engine.step()
        state = engine.state_of(first)
        assert state is not None, "the running request ended before the long prompts were prefilled"
        produced.append(int(state[0].produced[0]))
    between = work.rows_between_steps()
    assert max(between) <= chunk and len(between) > SYSTEM_ROWS // chunk
    assert produced == list(range(produced[0], produced[0] + len(produced)))  # a frame at every step
    assert (cache.misses, cache.hits) == (1, 2)
    assert engine.stats.prefill_rows - rows_before == sum(r.input_ids.shape[1] for r in longs) - 2 * SYSTEM_ROWS
    while not engine.idle:
        engine.step()
    for request, handle in zip([running, *longs], [first, *handles]):
        result = handle.result(timeout=1)
        expected, reason = generate_alone(model, request)
        assert torch.equal(result.codes, expected), f"seed {request.seed}"
        assert result.finish_reason == reason


@pytest.mark.parametrize("share", [1.0, 0.25])
def test_prefill_takes_at_most_its_share_of_the_scheduler_time_while_requests_run(model, monkeypatch, share):
    """Time counted as work (a row 1, a decode step 8): a prompt submitted to an idle engine is
    prefilled turn after turn with no step between; one that arrives beside a running request
    waits, after each turn of r rows, for the fewest steps that give the running request r * (1 -
    share) / share of decode time (share 1.0: one step), so prefill takes at most its share."""
    chunk, step_cost = 8, 8.0
    engine = Drama3Engine(model, max_batch=2, prefill_chunk=chunk, prefill_share=share)
    work = Work(engine, model, monkeypatch, step_cost=step_cost)
    running = job(seed=3, prompt_seed=70, text_rows=20)
    running.max_new_tokens = 200
    first = engine.submit(running)
    calls = 0
    while engine.state_of(first) is None:
        engine.step()
        calls += 1
    assert calls == 4 and [event[0] for event in work.events] == ["rows"] * calls + ["step"]  # a turn per call, no step
    work.events.clear()
    long = engine.submit(voiced(seed=4, turn_seed=5, tail_rows=4))  # 43 rows: pieces of 8, 8, 8, 8, 3, 8
    while engine.state_of(long) is None:
        engine.step()
    assert engine.state_of(first) is not None  # the running request outlasted the prefill
    turns = work.turns()[:-1]  # the last turn's steps run after the prompt joined
    assert len(turns) == 5
    for rows, steps in turns:
        owed = rows * (1 - share) / share
        assert steps == max(1, math.ceil(owed / step_cost)), (rows, steps, turns)
    prefilled = sum(rows for rows, _ in turns)
    decoded = step_cost * sum(steps for _, steps in turns)
    assert prefilled / (prefilled + decoded) <= share + 1e-9
    first.cancel()
    while not engine.idle:
        engine.step()


def _prefilled_state(engine, watched) -> list[torch.Tensor]:
    """Drive `engine` until idle; what `watched`'s prefilled run holds when it joins the batch: the
    backbone output of its open row, then its key mask, keys and values, conv and recurrent states."""
    held = []
    join = engine._join

    def joined(run, slot):
        if slot.handle.job is watched:
            filled = run.cache.backbone_part.filled
            held.extend([run.state.hidden.clone(), run.state.key_mask[:, :filled].clone(),
                         *run.cache.item_tensors(0, filled)])
        return join(run, slot)

    engine._join = joined
    while not engine.idle:
        engine.step()
    return held


def test_a_prompt_is_prefilled_in_the_same_pieces_whatever_else_runs_bitwise_in_float32():
    """A long voiced prompt's prefilled state (float32) is the same bitwise prefilled alone without
    the prefix cache, beside a running request and another prompt of its voice with the cache cold
    (its system turn prefilled a piece at a time, by whichever prompt comes first), and with the
    cache warm: the pieces are cut at rows that depend only on the prompt."""
    model32 = tiny_model(seed=0)
    target = voiced(seed=1, turn_seed=2, tail_rows=26)
    alone = Drama3Engine(model32, max_batch=4, prefill_chunk=8)
    alone.submit(target)
    reference = _prefilled_state(alone, target)

    cache = PrefixCache()
    busy = Drama3Engine(model32, max_batch=4, prefill_chunk=8, prefix_cache=cache, prefill_share=1.0)
    busy.submit(job(seed=3, prompt_seed=70, text_rows=12))
    busy.step()
    busy.submit(voiced(seed=4, turn_seed=5, tail_rows=4))  # fewer rows: it goes first and meets the miss
    busy.submit(target)
    cold = _prefilled_state(busy, target)
    assert (cache.misses, cache.hits) == (1, 1)

    warm_engine = Drama3Engine(model32, max_batch=4, prefill_chunk=8, prefix_cache=cache)
    warm_engine.submit(target)
    warm = _prefilled_state(warm_engine, target)
    assert cache.hits == 2
    assert len(reference) == len(cold) == len(warm) > 4
    for expected, got_cold, got_warm in zip(reference, cold, warm):
        assert torch.equal(got_cold, expected) and torch.equal(got_warm, expected)


def test_a_short_prompt_arriving_behind_long_ones_runs_before_they_are_prefilled(model):
    """The fewest rows left go first: a short request that arrives while two long prompts are being
    prefilled is prefilled in the next turns and draws frames before either long prompt is whole;
    a long prompt in part prefilled that is cancelled leaves at the next step; the others get their
    codes alone."""
    longs = [voiced(seed=3 + i, turn_seed=30 + i, tail_rows=30, voice_seed=8 + i) for i in range(2)]
    short = job(seed=4, prompt_seed=75)  # 16 rows: pieces of 8, 1 (its system turn ends at row 9) and 7
    engine = Drama3Engine(model, max_batch=4, prefill_chunk=8)
    handles = [engine.submit(request) for request in longs]
    engine.step()
    engine.step()
    assert [prompt.handle for prompt in engine._prefilling] == handles[:1]  # one at a time, the oldest first
    second = engine.submit(short)
    steps = 0
    while engine.state_of(second) is None:
        engine.step()
        steps += 1
    # turns 3 and 5 prefill its pieces; turn 4 (every OLDEST_EVERY-th) starts with the oldest prompt's
    assert steps == 3 and OLDEST_EVERY == 4
    assert all(engine.state_of(handle) is None for handle in handles)  # both long prompts still to come
    handles[0].cancel()  # in part prefilled
    engine.step()
    assert handles[0].result(timeout=1).kind == "cancelled" and handles[0] not in [p.handle for p in engine._prefilling]
    while not engine.idle:
        engine.step()
    for request, handle in ((longs[1], handles[1]), (short, second)):
        assert torch.equal(handle.result(timeout=1).codes, generate_alone(model, request)[0])


def test_the_oldest_prompt_gets_a_piece_every_fourth_turn_under_a_stream_of_short_ones(model):
    """A long prompt waits while a short request arrives at every step (each has fewer rows left, so
    each would go first): the long prompt still advances on every OLDEST_EVERY-th turn and joins
    while they keep coming, instead of waiting for them to stop."""
    long = voiced(seed=1, turn_seed=2, tail_rows=4)
    engine = Drama3Engine(model, max_batch=8, prefill_chunk=8, prefill_share=1.0)  # a turn at every step
    handle = engine.submit(long)
    fills, shorts = [], []
    while engine.state_of(handle) is None and handle.finished_at is None and len(fills) < 100:
        shorts.append(engine.submit(job(seed=100 + len(fills), prompt_seed=200 + len(fills) % 7)))
        engine.step()
        prompt = next((prompt for prompt in engine._prefilling if prompt.handle is handle), None)
        fills.append(prompt.filled if prompt is not None else 0 if handle in engine._waiting else long.input_ids.shape[1])
    assert fills[-1] == long.input_ids.shape[1] and len(fills) < 100  # it joined while the short ones still came
    advanced = [turn for turn, (before, after) in enumerate(zip([0, *fills], fills), start=1) if after > before]
    assert advanced[0] <= OLDEST_EVERY and all(b - a <= OLDEST_EVERY for a, b in zip(advanced, advanced[1:]))
    assert len(advanced) < len(fills) // 2  # the short ones did go first on the other turns
    for short in shorts:
        short.cancel()
    while not engine.idle:
        engine.step()
    assert isinstance(handle.result(timeout=1), DoneEvent)


def test_the_pool_grows_once_for_a_prompt_many_times_its_columns(model):
    """A prompt that needs several doublings of the pool's columns grows it in one copy when it joins."""
    engine = Drama3Engine(model, max_batch=2, capacity=8, prefill_chunk=64, prefill_share=1.0)
    grown = []
    original = engine._grow
    engine._grow = lambda *capacity: grown.append(capacity) or original(*capacity)
    short = engine.submit(job(seed=1, prompt_seed=2))  # 16 rows: a pool of 32 columns
    engine.step()
    assert engine._pool.capacity == 32 and engine.state_of(short) is not None
    long = engine.submit(voiced(seed=2, turn_seed=3, tail_rows=90))  # 129 rows: 256 columns
    while engine.state_of(long) is None:
        engine.step()
    assert grown == [(256,)] and engine._pool.capacity == 256


def test_a_prefix_is_stored_only_at_the_end_of_its_system_turn(model):
    """The cache refuses a run that is not the job's prompt prefilled exactly to its system turn's
    end (it would hand later requests a wrong prefix), and a job's changed system turn misses."""
    from transformers_drama3.serving.engine import prefill_alone

    request = voiced(seed=1, turn_seed=2, tail_rows=4)
    cache = PrefixCache()
    with pytest.raises(ValueError, match="a run of 36 rows is not the system turn"):
        cache.store(request, prefill_alone(model, request, SYSTEM_ROWS + 1))
    cache.store(request, prefill_alone(model, request, SYSTEM_ROWS))
    assert cache.lookup(model, voiced(seed=1, turn_seed=9, tail_rows=6)) is not None
    changed = voiced(seed=1, turn_seed=2, tail_rows=4)
    changed.audio_codes = changed.audio_codes.clone()
    changed.audio_codes[0, 7, 0] += 1  # the voice's clip changed under the same key
    assert cache.lookup(model, changed) is None and (cache.hits, cache.misses) == (1, 1)


def test_drama3_serve_passes_prefill_chunk_and_share_to_the_engine_and_refuses_bad_ones(monkeypatch, capsys, tmp_path):
    """`--prefill-chunk` and `--prefill-share` reach the service's engine (unset: 128 rows on a CPU and
    a share of 0.5); a share outside (0, 1] is refused before anything loads."""
    pytest.importorskip("uvicorn")
    from transformers_drama3 import cli
    from transformers_drama3.cli import main
    from transformers_drama3.serving import app as app_module
    from transformers_drama3.serving.chunked_prefill import DEFAULT_PREFILL_SHARE
    from transformers_drama3.serving.service import SpeechService

    started = {}
    monkeypatch.setattr(app_module, "serve_in_background",
                        lambda *args, **kwargs: (started.setdefault("load", kwargs), ((lambda: None), None))[1])
    monkeypatch.setattr(cli, "listen", lambda host, port: None)  # binds nothing
    monkeypatch.setattr(cli, "run_server", lambda *args: None)  # serves nothing: the call returns
    assert main(["serve", "--prefill-chunk", "64", "--prefill-share", "0.25"]) == 0
    assert (started["load"]["prefill_chunk"], started["load"]["prefill_share"]) == (64, 0.25)
    for bad in ("0", "1.5", "nan"):
        assert main(["serve", "--prefill-share", bad]) == 2
        assert f"--prefill-share {float(bad)}: expected a fraction in (0, 1]" in capsys.readouterr().err
    service = SpeechService.load(voices_dir=str(tmp_path / "voices"), start_engine=False, threads=1,
                                 prefill_chunk=64, prefill_share=0.25)
    assert (service.engine.prefill_chunk, service.engine.prefill_share) == (64, 0.25)
    assert service.engine.prefix_cache is service.metrics.prefix_cache is not None  # the engine prefills voice prefixes through it
    unset = SpeechService.load(voices_dir=str(tmp_path / "voices"), start_engine=False, threads=1)
    assert (unset.engine.prefill_chunk, unset.engine.prefill_share) == (128, DEFAULT_PREFILL_SHARE) == (128, 0.5)
