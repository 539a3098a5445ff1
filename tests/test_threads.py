"""The decode thread count: chosen from the model's size and the idle cores, overridable, restored."""

import pytest
import torch
from generation_helpers import prompt, tiny_model

from transformers_drama3.runtime.command_line import build_parser
from transformers_drama3.decoding import threads
from transformers_drama3.serving.engine import Drama3Engine

MIB = 2**20


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_a_model_below_two_threads_worth_of_weights_decodes_on_one_thread():
    assert threads.threads_for(threads.BYTES_PER_THREAD - 1, cores=16, busy=0) == 1


def test_a_large_model_on_an_idle_machine_uses_every_core():
    assert threads.threads_for(64 * threads.BYTES_PER_THREAD, cores=8, busy=0) == 8


def test_cores_busy_with_other_processes_are_left_to_them():
    assert threads.threads_for(64 * threads.BYTES_PER_THREAD, cores=8, busy=3) == 5


def test_a_fully_busy_machine_still_gets_one_thread():
    assert threads.threads_for(64 * threads.BYTES_PER_THREAD, cores=2, busy=5) == 1


def test_the_size_caps_the_threads_on_an_idle_machine():
    assert threads.threads_for(3 * threads.BYTES_PER_THREAD, cores=16, busy=0) == 3


def test_runnable_tasks_are_read_from_the_loadavg_running_field(tmp_path):
    path = tmp_path / "loadavg"
    path.write_text("1.16 0.68 0.29 3/93 7600\n")
    assert threads.runnable_tasks(str(path)) == 3


def test_without_a_loadavg_file_nothing_counts_as_busy(tmp_path):
    assert threads.runnable_tasks(str(tmp_path / "missing")) is None


def test_own_runnable_threads_counts_state_r_only(tmp_path):
    for task, state in (("1", "R"), ("2", "S"), ("3", "R")):
        (tmp_path / task).mkdir()
        # the command name may hold spaces and parentheses: the state follows the last ")"
        (tmp_path / task / "stat").write_text(f"{task} (py (worker) 1) {state} 1 2 3\n")
    assert threads.own_runnable_threads(str(tmp_path)) == 2


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    path = tmp_path / "cpu.max"
    path.write_text("150000 100000\n")
    assert threads.cgroup_cpu_quota(str(path)) == 2
    path.write_text("max 100000\n")
    assert threads.cgroup_cpu_quota(str(path)) is None


def test_weight_bytes_per_frame_counts_the_routed_share_of_the_experts(model):
    text = model.config.text_config
    experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".mlp.experts." in name)
    with_all = threads.weight_bytes_per_frame(model)
    text.num_experts_per_tok, saved = text.num_experts, text.num_experts_per_tok
    try:
        every_expert = threads.weight_bytes_per_frame(model)
    finally:
        text.num_experts_per_tok = saved
    assert every_expert - with_all == pytest.approx(experts * (1 - saved / text.num_experts), abs=2)


def test_the_tiny_model_decodes_on_one_thread_whatever_the_load(model):
    assert threads.decode_threads(model) == 1


def test_torch_threads_sets_the_count_inside_and_restores_it_after():
    before = torch.get_num_threads()
    with threads.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def decode_thread_counts(model, monkeypatch, **kwargs) -> set[int]:
    """The torch thread counts seen by each decode step of one generate() call."""
    seen = set()
    speech_logits = model.speech_logits  # read once per decode step, by its draw

    def recording(*args, **inner):
        seen.add(torch.get_num_threads())
        return speech_logits(*args, **inner)

    monkeypatch.setattr(model, "speech_logits", recording)
    input_ids, audio_codes = prompt(0)
    model.generate(input_ids[None], audio_codes[None], do_sample=False, max_new_tokens=3, **kwargs)
    return seen


def test_generate_decodes_with_the_threads_it_is_given_and_restores_the_callers(model, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert decode_thread_counts(model, monkeypatch, threads=1) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_generate_chooses_one_thread_for_the_tiny_model_by_default(model, monkeypatch):
    assert decode_thread_counts(model, monkeypatch) == {1}


def test_generate_with_threads_none_leaves_torchs_count(model, monkeypatch):
    count = torch.get_num_threads()
    assert decode_thread_counts(model, monkeypatch, threads=None) == {count}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_generate_refuses_a_bad_thread_count_naming_it(model, bad):
    input_ids, audio_codes = prompt(0)
    with pytest.raises(ValueError, match="threads="):
        model.generate(input_ids[None], audio_codes[None], max_new_tokens=2, threads=bad)


def test_the_engine_refuses_a_bad_thread_count(model):
    with pytest.raises(ValueError, match="threads=0"):
        Drama3Engine(model, threads=0)


@pytest.mark.parametrize("command", [["say", "hi", "-o", "x.wav"], ["serve"]])
def test_the_command_line_takes_threads_auto_or_a_count(command):
    parser = build_parser()
    assert parser.parse_args(command).threads == "auto"
    assert parser.parse_args([*command, "--threads", "3"]).threads == 3


@pytest.mark.parametrize("bad", ["0", "-2", "many"])
def test_the_command_line_refuses_a_bad_thread_count(bad, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["say", "hi", "-o", "x.wav", "--threads", bad])
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("size, cores, busy, expected", [
    (64, 8, 0, 8), (64, 8, 3, 5), (64, 2, 5, 1), (3, 16, 0, 3), (1, 16, 0, 1),
])
def test_decode_threads_follows_the_model_size_and_the_cores_others_keep_busy(model, monkeypatch, size, cores, busy, expected):
    """`decode_threads` itself (not only `threads_for`), with the load and the model's size faked:
    it reads both, so a version that ignored busy cores or the size would choose otherwise."""
    monkeypatch.setattr(threads, "weight_bytes_per_frame", lambda _: size * threads.BYTES_PER_THREAD)
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda *args, **kwargs: busy)
    assert threads.decode_threads(model) == expected
