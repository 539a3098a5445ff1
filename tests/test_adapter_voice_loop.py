"""The loop a user runs, end to end on drama3-tiny: a folder of clips of a voice ->
examples/finetune_voice_lora.py (a few steps) -> `drama3 serve --adapter me=out/adapter` -> the
official openai client speaks with voice="me": the take is the merged checkpoint's (out/merged),
differs from the base model's take of the same request, and its speaker similarity to the voice
is measured beside the base model's (the project's instrument: resemblyzer, recipes/drama3_tiny)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from network_helpers import serving_on_loopback

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from recipes.drama3_tiny import instruments as I  # noqa: E402
from recipes.drama3_tiny.corpus import SAMPLING_RATE, Voice, espeak_available, synthesize, write_wav  # noqa: E402
from transformers_drama3 import Drama3ForSpeechGeneration  # noqa: E402
from transformers_drama3.cli import check_adapter_flags  # noqa: E402
from transformers_drama3.cli_arguments import build_parser  # noqa: E402
from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.audio_formats import pcm16  # noqa: E402
from transformers_drama3.serving.protocol import Limits, parse_speech  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LSB = 1 / 32767
VOICE = Voice("C", "en-gb", "m4")  # the corpus leaves this espeak voice out: drama3-tiny never heard it
TRAINING = (
    "Could you hand me that blue towel on the rack?",
    "What time does your shift end tonight?",
    "We ran out of toilet paper again.",
    "Did you remember to grab the mail on your way in?",
    "I'm running about ten minutes late, sorry about that.",
)
HELD_OUT = ("The old fisherman carried a heavy lantern to the harbour.", "Please open the window before breakfast.")
SPOKEN = ("My cousin keeps forty two pebbles in a wooden box.", "Why did the sleepy donkey wander across the valley?")
STEPS = 4

needs_tools = pytest.mark.skipif(
    not espeak_available() or importlib.util.find_spec("resemblyzer") is None,
    reason=f"needs espeak-ng and resemblyzer ({I.INSTALL_HINT})",
)


def finetune_example():
    spec = importlib.util.spec_from_file_location("finetune_voice_lora", ROOT / "examples" / "finetune_voice_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def voice_folder(folder: Path) -> Path:
    folder.mkdir()
    for index, sentence in enumerate(TRAINING):
        write_wav(folder / f"clip{index}.wav", synthesize(sentence, VOICE))
        (folder / f"clip{index}.txt").write_text(sentence)
    return folder


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def similarity(waveform, rate: int, centroid) -> float:
    return I.speaker_similarity(I.speaker_embedding(waveform, rate), centroid)


@pytest.mark.slow
@needs_tools
def test_a_voice_fine_tuned_with_the_example_is_served_to_the_openai_client(tmp_path, record_property):
    voice = voice_folder(tmp_path / "my_voice")
    out = tmp_path / "out"
    finetune_example().main([
        "--model", shipped.TINY_MODEL_PATH, "--voice", str(voice), "--output", str(out), "--rank", "8",
        "--max-steps", str(STEPS), "--batch-size", "2", "--learning-rate", "5e-3", "--cpu", "--min-speech-fraction", "0",
    ])
    clip = f"{voice / 'clip0.wav'}:{voice / 'clip0.txt'}"
    # drama3 serve --adapter me=out/adapter --voice me=clip (the adapter with a reference clip of the
    # voice) --voice ref=clip (the same clip on the base model: the same prompt without the adapter)
    args = build_parser().parse_args(["serve", "--adapter", f"me={out / 'adapter'}", "--voice", f"me={clip}", "--voice", f"ref={clip}"])
    check_adapter_flags(args)
    service = SpeechService.load(None, str(tmp_path / "voices"), voice_specs=args.voice, adapter_specs=args.adapter,
                                 max_adapters=args.max_adapters, adapter_rank=args.adapter_rank)
    # float64, as the merged checkpoint below: the slots' sums and the merged weights round alike
    service.model.set_experts_implementation("eager")
    service.model.double()
    merged = Drama3ForSpeechGeneration.from_pretrained(out / "merged").eval()
    merged.set_experts_implementation("eager")
    merged.double()
    centroid = I.voice_centroid([I.speaker_embedding(synthesize(s, VOICE), SAMPLING_RATE) for s in HELD_OUT])
    scores = {"me": [], "ref": []}
    app = create_app(lambda: service, ServerSettings(request_timeout=300))
    try:
        with serving_on_loopback(app) as port:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            for seed, text in enumerate(SPOKEN):
                takes = {}
                for name in ("me", "ref"):
                    response = client.audio.speech.create(model="drama3-tiny", input=text, voice=name, response_format="pcm",
                                                          extra_body={"seed": seed})
                    takes[name] = pcm_samples(response.content)
                    scores[name].append(similarity(takes[name], service.processor.sampling_rate, centroid))
                assert takes["me"].shape != takes["ref"].shape or not np.allclose(takes["me"], takes["ref"], atol=1e-3)
                body = {"model": "drama3-tiny", "input": text, "voice": "me", "seed": seed}
                job = service.job(parse_speech(body, Limits(), service.has_voice), None)
                codes = merged.generate(job.input_ids, job.audio_codes, seed=seed, max_new_tokens=job.max_new_tokens,
                                        temperature=job.settings.temperature, top_p=job.settings.top_p,
                                        top_k=job.settings.top_k, do_sample=job.settings.do_sample,
                                        return_dict_in_generate=True)
                expected = service.waveform(codes.audio_codes[0, : int(codes.lengths[0])])
                expected = pcm_samples(pcm16(expected))
                assert takes["me"].shape == expected.shape
                np.testing.assert_allclose(takes["me"], expected, atol=2 * LSB, rtol=0)
    finally:
        service.engine.stop()
    adapted, base = float(np.mean(scores["me"])), float(np.mean(scores["ref"]))
    record_property("speaker_similarity", {"adapter": adapted, "base": base, "steps": STEPS})
    print(f"speaker similarity to the voice after {STEPS} steps: adapter {adapted:.3f}, base {base:.3f}")
    assert all(-1.0 <= score <= 1.0 for score in scores["me"] + scores["ref"])
