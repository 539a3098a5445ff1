"""The demo's voice menus offer fine-tuned voices (LoRA adapters the demo was started with): a
script spoken with one speaks with its adapter, and its take is the PEFT-merged model's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

gr = pytest.importorskip("gradio")

from transformers_drama3.serving.adapter_layers import BASE_FILE, base_fingerprint  # noqa: E402
from transformers_drama3.serving.demo import Director, VoiceChoice, load_backend  # noqa: E402
from transformers_drama3.training.lora import apply_lora  # noqa: E402

FRAMES = 12


@pytest.fixture(scope="module")
def demo(tmp_path_factory, bundled_tiny):
    base, _ = bundled_tiny
    folder = tmp_path_factory.mktemp("adapter") / "calm"
    peft = apply_lora(copy.deepcopy(base), "light", r=4)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, parameter in peft.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    peft.save_pretrained(folder)
    (folder / BASE_FILE).write_text(json.dumps(base_fingerprint(base.config)))
    merged = peft.merge_and_unload().eval()
    merged.set_experts_implementation("eager")
    merged.double()
    backend = load_backend(None, "cpu", 4, adapter_specs=[f"calm={folder}"])
    backend.service.model.set_experts_implementation("eager")  # float64: the slots and the merge round alike
    backend.service.model.double()
    yield Director(backend), merged
    backend.service.engine.stop()


def test_the_voice_menu_lists_fine_tuned_voices(demo):
    director, _ = demo
    assert "calm" in director.voice_names and "A" in director.voice_names


def test_a_fine_tuned_voice_speaks_the_merged_models_take(demo):
    director, merged = demo
    voices = [VoiceChoice(0, "calm"), VoiceChoice(1, "A")]
    script = director.script("Good morning to you, and welcome back.", "", voices)
    requests = director.scene_requests(script, voices)
    assert [request.adapter for request in requests] == ["calm"]
    settings = director.settings("model default", seed=4, max_new_tokens=FRAMES)
    take = [update for update in director.speak(requests, settings, 1)][-1].take
    job = director.job(requests[0], settings, settings.seed)
    assert job.adapter == "calm"
    out = merged.generate(job.input_ids, job.audio_codes, seed=job.seed, max_new_tokens=job.max_new_tokens,
                          do_sample=job.settings.do_sample, temperature=job.settings.temperature,
                          top_p=job.settings.top_p, top_k=job.settings.top_k, return_dict_in_generate=True)
    assert take.requests[0].codes.shape[0] > 0
    assert torch.equal(take.requests[0].codes, out.audio_codes[0, : int(out.lengths[0])])
    assert [request.adapter for request in take.revised("slower")] == ["calm"]


def test_a_scene_with_a_clipless_fine_tuned_voice_and_another_speaker_is_refused_naming_the_speaker(demo):
    director, _ = demo
    voices = [VoiceChoice(0, "calm"), VoiceChoice(1, "A")]
    with pytest.raises(gr.Error, match="Speaker 0 voice: the fine-tuned voice 'calm' has no reference clip"):
        director.script("<|speaker:0|> Good morning. <|speaker:1|> Hello to you.", "", voices)


def test_drama3_demo_refuses_a_bad_adapter_flag_before_loading(tmp_path):
    from transformers_drama3.cli import check_adapter_specs
    from transformers_drama3.runtime.command_line import build_parser
    from transformers_drama3.runtime.loading import CommandError

    args = build_parser().parse_args(["demo", "--adapter", f"me={tmp_path}"])
    check_adapter_specs(args.adapter)
    with pytest.raises(CommandError, match="is not a folder"):
        check_adapter_specs(build_parser().parse_args(["demo", "--adapter", f"me={tmp_path / 'no'}"]).adapter)
