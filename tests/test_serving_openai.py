"""OpenAI's names and formats on the live server (issue 47): preset voice names speak (an operator's
alias, else the default voice) and unknown names are still refused; the model listings name what
is accepted; every response format decodes back (with PyAV) to the take."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile
from network_helpers import serving_on_loopback

pytest.importorskip("uvicorn")

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.openai_names import (  # noqa: E402
    OPENAI_SPEECH_MODELS,
    OPENAI_VOICES,
    VoiceAliases,
)
from transformers_drama3.serving.voices import VoiceReference  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

API_KEY = "openai-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WAIT = 60
FRAMES = 12


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def base(service):
    aliases = VoiceAliases.from_specs(["alloy=B", "narrator=B", "ghost=nobody"])
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, voice_aliases=aliases))
    with serving_on_loopback(app) as port:
        yield f"http://127.0.0.1:{port}"


def pcm(base: str, voice, seed: int = 5, **fields) -> httpx.Response:
    body = {"model": "tts-1", "input": "Hello there.", "voice": voice, "response_format": "pcm", "seed": seed,
            "max_new_tokens": FRAMES, **fields}
    return httpx.post(base + "/v1/audio/speech", json=body, headers=HEADERS, timeout=WAIT)


def test_the_preset_voices_are_openai_s():
    openai = pytest.importorskip("openai")
    import typing

    from openai.types.audio import speech_create_params

    literal = [arg for arg in typing.get_args(speech_create_params.Voice) if typing.get_origin(arg) is typing.Literal]
    assert set(OPENAI_VOICES) == set(typing.get_args(literal[0])), openai.__version__


def test_an_aliased_preset_speaks_its_voice_and_an_unaliased_one_the_default(base):
    as_b, b = pcm(base, "alloy"), pcm(base, "B")
    assert as_b.status_code == 200 and as_b.content == b.content
    as_default, a = pcm(base, "echo"), pcm(base, "A")  # drama3-tiny's default voice is A
    assert as_default.status_code == 200 and as_default.content == a.content
    assert a.content != b.content
    assert pcm(base, {"id": "narrator"}).content == b.content  # OpenAI's custom-voice spelling, an operator's alias


def test_a_stored_voice_wins_over_a_preset_of_its_name(base, service):
    clip, transcript = shipped.reference_voice("B")
    samples, rate = soundfile.read(clip, dtype="float32")
    service.voices.add("shimmer", [VoiceReference(samples, rate, transcript, 0)], "shimmer")
    try:
        assert pcm(base, "shimmer").content == pcm(base, "B").content
    finally:
        service.voices.delete("shimmer")


@pytest.mark.parametrize("voice", ["nobody", "Alloy", "alloy2"])
def test_a_name_that_is_neither_stored_nor_a_preset_is_refused_404(base, voice):
    refused = pcm(base, voice)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "voice"
    assert refused.json()["error"]["code"] == "voice_not_found"


def test_an_alias_of_a_voice_that_is_not_stored_is_refused_naming_both(base):
    refused = pcm(base, "ghost")
    assert refused.status_code == 404
    message = refused.json()["error"]["message"]
    assert "ghost" in message and "nobody" in message


def test_a_text_stream_accepts_a_preset_voice(base):
    websockets_sync = pytest.importorskip("websockets.sync.client")
    with websockets_sync.connect(base.replace("http", "ws") + "/v1/audio/speech/stream", additional_headers=HEADERS,
                                 open_timeout=WAIT) as connection:
        connection.send(json.dumps({"type": "start", "voice": "alloy", "max_new_tokens": 4}))
        assert json.loads(connection.recv(timeout=WAIT))["type"] == "ready"


def test_the_listings_name_the_served_model_and_openai_s_names_as_its_aliases(base):
    models = httpx.get(base + "/v1/models", headers=HEADERS, timeout=WAIT).json()["data"]
    assert models[0]["id"] == "drama3-tiny" and "alias_of" not in models[0]
    assert [model["id"] for model in models[1:]] == list(OPENAI_SPEECH_MODELS)
    assert {model["alias_of"] for model in models[1:]} == {"drama3-tiny"}
    audio_models = httpx.get(base + "/v1/audio/models", headers=HEADERS, timeout=WAIT).json()["models"]
    assert audio_models == [{"id": model["id"]} for model in models]
    voices = httpx.get(base + "/v1/audio/voices", headers=HEADERS, timeout=WAIT).json()
    assert {"alias": "alloy", "voice": "B"} in voices["aliases"]


@pytest.mark.parametrize("spec", ["alloy", "=A", "alloy=", "alloy=A,alloy=B"])
def test_a_malformed_or_repeated_alias_is_refused_naming_it(spec):
    with pytest.raises(ValueError, match="--voice-alias"):
        VoiceAliases.from_specs(spec.split(","))


# ---- every response format, written by PyAV, decodes back to the take ---------------------------------

av = pytest.importorskip("av")
MODEL_RATE = 22050  # drama3-tiny's
FORMAT_FRAMES = 40  # ~1.9 s of drama3-tiny audio: long enough for the coders' frames and padding
PADDING_SECONDS = 0.11
"""What a lossy coder may add to a take's length: two mp3 frames of 1,152 samples at 22,050 Hz (a
streamed mp3 has no Xing header to say what to trim), more than aac's 1,024-sample priming."""


def take_bytes(base: str, response_format: str, delivery: str = "whole") -> bytes:
    body = {"input": "Hello there, how are you today?", "voice": "A", "response_format": response_format, "seed": 9,
            "max_new_tokens": FORMAT_FRAMES}
    if response_format == "pcm":
        body["sample_rate"] = MODEL_RATE  # the take as the model made it (pcm is 24 kHz by default)
    if delivery == "whole":
        body["stream"] = False
    else:
        body["stream_format"] = delivery
    response = httpx.post(base + "/v1/audio/speech", json=body, headers=HEADERS, timeout=WAIT)
    assert response.status_code == 200, response.text
    if delivery != "sse":
        return response.content
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    return b"".join(base64.b64decode(event["audio"]) for event in events if event["type"] == "speech.audio.delta")


def decoded(data: bytes, rate: int | None = None) -> tuple[np.ndarray, int, str]:
    """(samples [n] as float32, or int16 for a 16-bit stream when `rate` is None; the coded rate; codec name)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        coded_rate, codec = stream.codec_context.sample_rate, stream.codec_context.name
        if rate is None:
            frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        else:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            frames = [out.to_ndarray().reshape(-1) for frame in container.decode(stream) for out in resampler.resample(frame)]
            frames += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    return np.concatenate(frames), coded_rate, codec


def aligned_correlation(reference: np.ndarray, coded: np.ndarray, max_lag: int = 4096) -> float:
    """The largest normalised correlation of `coded` with `reference` over lags of up to `max_lag`
    samples (coders delay the audio by their priming)."""
    best = -1.0
    for lag in range(0, max_lag + 1):
        a, b = reference, coded[lag:]
        n = min(a.size, b.size)
        if n < reference.size // 2:
            break
        a, b = a[:n] - a[:n].mean(), b[:n] - b[:n].mean()
        best = max(best, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12)))
    return best


@pytest.fixture(scope="module")
def take(base, service):
    """The take as 16-bit samples (pcm) and its rate."""
    assert service.processor.sampling_rate == MODEL_RATE
    samples = np.frombuffer(take_bytes(base, "pcm"), dtype="<i2")
    assert samples.size > service.processor.sampling_rate  # over a second of audio
    return samples, service.processor.sampling_rate


def test_flac_is_the_takes_16_bit_samples_exactly_whole_and_streamed(base, take):
    samples, rate = take
    for delivery in ("whole", "audio"):
        audio, coded_rate, codec = decoded(take_bytes(base, "flac", delivery))
        assert codec == "flac" and coded_rate == rate and audio.dtype == np.int16
        np.testing.assert_array_equal(audio, samples)


@pytest.mark.parametrize("delivery", ["whole", "audio", "sse"])
@pytest.mark.parametrize("response_format, codec", [("mp3", "mp3"), ("opus", "opus"), ("aac", "aac")])
def test_a_lossy_format_decodes_to_the_take_at_its_rate_and_length(base, take, response_format, codec, delivery):
    samples, rate = take
    reference = samples.astype(np.float32) / 32767
    data = take_bytes(base, response_format, delivery)
    audio, coded_rate, coded_codec = decoded(data, rate)
    assert coded_codec.startswith(codec)
    assert coded_rate == (48000 if response_format == "opus" else rate)
    assert -0.01 <= (audio.size - reference.size) / rate <= PADDING_SECONDS
    assert aligned_correlation(reference, audio) > 0.9


def test_a_streamed_format_sends_audio_before_the_take_ends(base):
    """mp3 in a stream comes in several pieces as frames are made, not one piece at the end."""
    body = {"input": "Hello there, how are you today?", "voice": "A", "response_format": "mp3", "seed": 9,
            "max_new_tokens": FORMAT_FRAMES, "stream": True}
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, headers=HEADERS, timeout=WAIT) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        pieces = [piece for piece in response.iter_raw() if piece]
    assert len(pieces) >= 3
    assert decoded(b"".join(pieces), 22050)[0].size > 0
