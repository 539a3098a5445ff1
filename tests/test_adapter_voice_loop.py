"""The loop a user runs, end to end on drama3-tiny: a folder of clips of a voice ->
examples/finetune_voice_lora.py (a few steps) -> `drama3 serve --adapter me=out/adapter` -> the
official openai client speaks with voice="me": the take is the merged checkpoint's (out/merged),
differs from the base model's take of the same request, and is closer to the voice than the base
model's take (speaker similarity, the project's instrument: resemblyzer, recipes/drama3_tiny)."""

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
from transformers_drama3.runtime.command_line import build_parser  # noqa: E402
from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.audio_formats import pcm16  # noqa: E402
from transformers_drama3.serving.protocol import Limits, parse_speech  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LSB = 1 / 32767
# drama3-tiny's language model was trained on voices A and B only; its phonetic codec writes the
# voice of each frame as one label of a fixed set (codebook 1), and this voice (the corpus's F, which
# the model never heard) gets its own label, "m7 p50": codec resynthesis scores 0.91 to the voice,
# against 0.79 as A's label and 0.61 as B's. A voice the codec labels as A or B cannot be learnt:
# en-gb+m4 is coded as A's label ("m1 p50", resemblyzer 0.89 to A), and the base model already
# speaks it (4 steps: adapter 0.849 against base 0.841; 10 steps at 2e-3: 0.727 against 0.724).
VOICE = Voice("F", "en-029", "m7")
TRAINING = (
    "Could you hand me that blue towel on the rack?",
    "What time does your shift end tonight?",
    "We ran out of toilet paper again.",
    "Did you remember to grab the mail on your way in?",
    "I'm running about ten minutes late, sorry about that.",
)
HELD_OUT = ("The old fisherman carried a heavy lantern to the harbour.", "Please open the window before breakfast.")
SPOKEN = ("My cousin keeps forty two pebbles in a wooden box.", "Why did the sleepy donkey wander across the valley?")
STEPS = 12  # 4 steps left the adapter's voice label unsettled (it spoke "f4 p55 whisper" with the clip)
# Measured with these clips, 12 steps at 5e-3, rank 8 (float32, four takes each, training seeds 0 and
# 1): the adapter with the clip 0.914 +- 0.009 and 0.910 +- 0.007 (lowest take 0.897), the base
# model with the same clip 0.690 +- 0.035 (highest 0.732; it speaks A's label). The gain, 0.22, is
# six spreads of the base's takes; the test asks for 0.1 on the mean and every adapter take above
# every base take. The adapter with no clip ("plain") 0.882 +- 0.028 and 0.872 +- 0.026 (lowest
# 0.841): the fine-tuned voice alone beats the base model given a clip of the voice by the same rule.
MIN_GAIN = 0.1

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
    # --adapter plain=out/adapter (the same adapter with no clip: the fine-tuned voice alone)
    args = build_parser().parse_args(["serve", "--adapter", f"me={out / 'adapter'}", "--voice", f"me={clip}", "--voice", f"ref={clip}",
                                      "--adapter", f"plain={out / 'adapter'}"])
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
    scores = {"me": [], "ref": [], "plain": []}
    app = create_app(lambda: service, ServerSettings(request_timeout=300))
    try:
        with serving_on_loopback(app) as port:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            for seed, text in enumerate(SPOKEN):
                takes = {}
                for name in ("me", "ref", "plain"):
                    response = client.audio.speech.create(model="drama3-tiny", input=text, voice=name, response_format="pcm",
                                                          extra_body={"seed": seed, "sample_rate": service.processor.sampling_rate})
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
    adapted, base, plain = (float(np.mean(scores[name])) for name in ("me", "ref", "plain"))
    record_property("speaker_similarity", {"adapter": adapted, "adapter_without_clip": plain, "base": base, "steps": STEPS})
    print(f"speaker similarity to the voice after {STEPS} steps: adapter {adapted:.3f} (without the clip {plain:.3f}), "
          f"base with the clip {base:.3f}")
    assert all(-1.0 <= score <= 1.0 for score in scores["me"] + scores["ref"] + scores["plain"])
    for name, mean in (("me", adapted), ("plain", plain)):
        assert mean - base > MIN_GAIN, f"{name}: the fine-tuned voice is not closer to the voice: {scores[name]}, base {scores['ref']}"
        assert min(scores[name]) > max(scores["ref"]), f"{name}: {scores[name]}, base {scores['ref']}"
