"""The serving engine as it steps on CUDA (`decoding.loop.runs_ahead`, forced here on the CPU): the
next step is queued before the last one is read, so requests join, end, are cancelled or time out
while a step made with the batch as it was is still to be read. The engine's tests of what each
request gets (the codes `generate()` gives it alone, its stream, its end) run again this way."""

import pytest
import torch

from generation_helpers import recorded_step_order
from test_serving_engine import (  # noqa: F401  (the fixtures these tests use, and the tests run again here)
    drive, job, make_engine, model,
    test_a_cancelled_request_leaves_at_the_next_step_and_others_are_unchanged,
    test_a_compiled_engine_steps_buckets_of_requests_and_gives_each_the_codes_it_has_alone,
    test_a_request_alone_gives_generates_codes,
    test_line_by_line_prompts_draw_their_boundaries_in_the_engine_as_generate_draws_them,
    test_requests_joining_a_busy_batch_mid_flight_give_their_codes_alone,
    test_requests_past_their_time_limit_end_as_timeouts_waiting_or_running,
    test_slots_that_outgrow_the_pool_capacity_keep_their_codes,
    test_streamed_frames_join_to_the_final_codes,
    test_waiting_requests_beyond_max_batch_run_when_a_slot_frees,
    test_with_the_prefix_cache_a_request_gives_the_same_codes_alone_and_in_a_busy_batch,
)
from test_serving_chunked_prefill import (  # noqa: F401  (run again with the next step queued ahead)
    test_long_prompts_hold_a_running_request_one_turn_of_chunk_rows_at_most_and_change_no_codes,
)
from transformers_drama3.serving import engine as engine_module
from transformers_drama3.serving.engine import Drama3Engine


@pytest.fixture(autouse=True)
def queued_ahead(monkeypatch):
    monkeypatch.setattr(engine_module, "runs_ahead", lambda device: True)


def test_each_step_is_queued_before_the_last_one_is_read(model, monkeypatch):
    engine = Drama3Engine(model, max_batch=3)
    events = recorded_step_order(engine, monkeypatch, functions=("step_function",))
    drive(engine, {0: [job(seed=70, prompt_seed=71), job(seed=72, prompt_seed=73)], 2: [job(seed=74, prompt_seed=75)]})
    queued = 0
    for read, event in enumerate(index for index, event in enumerate(events) if event == "read"):
        queued = events[:event].count("step_function")
        assert queued >= read + 2, events  # the step read, and the next one, were queued before it
    assert events.count("read") < events.count("step_function")  # steps queued past the end, never read


def test_a_request_that_leaves_while_a_step_is_queued_gets_nothing_more(model):
    """A request cancelled, timed out or ended at the step read, whose item the step queued after it
    still stepped: it is finished once, and nothing follows its last event."""
    finished = []
    engine = Drama3Engine(model, max_batch=4, on_finish=lambda handle, outcome: finished.append((handle, outcome)))
    short = job(seed=80, prompt_seed=81)
    short = type(short)(short.input_ids, short.audio_codes, short.settings, seed=80, max_new_tokens=2)
    handles = [engine.submit(request) for request in (job(seed=82, prompt_seed=83), job(seed=84, prompt_seed=85), short)]
    engine.step()
    handles[1].cancel()
    while not engine.idle:
        engine.step()
    outcomes = {handles.index(handle): outcome for handle, outcome in finished}
    assert len(finished) == 3 and outcomes[1] == "cancelled" and outcomes[2] == "length"  # each finished once
    for handle in handles:
        events = list(handle.events(timeout=1))
        assert handle.queue.empty(), "an event came after the request's last one"
        assert all(type(event).__name__ == "FramesEvent" for event in events[:-1])
