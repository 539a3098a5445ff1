"""OpenAI's audio contract on `/v1/audio/speech`, as clients built for OpenAI assume it: `pcm` is
16-bit mono 24 kHz (the take resampled with soxr), `sample_rate` sets pcm's and wav's rate, the audio
streams unless `stream: false` (the first bytes leave while the take is still being made), `speed`
0.25-4.0 is a pitch-keeping time stretch (FFmpeg's atempo) streamed or whole, every response has an
`x-request-id`, and SSE without `response_format` carries mp3 (OpenAI's default format).

The stages (`serving.output_audio`) are checked against plain references: a tone keeps its pitch
and changes its length by the speed, and chunked processing equals processing the whole.
"""

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
import soundfile
import soxr
from network_helpers import serving_on_loopback

pytest.importorskip("uvicorn")
av = pytest.importorskip("av")

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.output_audio import (  # noqa: E402
    OPENAI_PCM_RATE,
    OutputAudio,
    TimeStretch,
    atempo_factors,
)

FRAMES = 40
LSB = 1 / 32767
WAIT = 120
TEXT = "Hello there, how are you today?"


# ---- the stages, against plain references ------------------------------------------------------------


@pytest.mark.parametrize("speed, factors", [(1.0, []), (2.0, [2.0]), (4.0, [2.0, 2.0]), (3.0, [2.0, 1.5]),
                                            (0.5, [0.5]), (0.25, [0.5, 0.5]), (0.3, [0.5, 0.6]), (1.25, [1.25])])
def test_a_speed_is_a_chain_of_atempo_factors_each_within_its_blending_range(speed, factors):
    chain = atempo_factors(speed)
    assert chain == pytest.approx(factors)
    assert all(0.5 <= factor <= 2.0 for factor in chain)
    assert np.prod(chain) == pytest.approx(speed)


@pytest.mark.parametrize("speed", [0.2, 4.01, float("nan")])
def test_a_speed_outside_openai_s_range_is_refused(speed):
    with pytest.raises(ValueError, match="speed"):
        atempo_factors(speed)


def tone(rate: int, seconds: float, frequency: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * frequency * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def peak_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.argmax(spectrum) * rate / samples.size)


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 2.0, 4.0])
def test_the_time_stretch_changes_the_length_by_the_speed_and_keeps_the_pitch(speed):
    rate = 22050
    source = tone(rate, 2.0)
    stretch = TimeStretch(rate, speed)
    out = np.concatenate([stretch.push(source), stretch.finish()])
    assert out.size / source.size == pytest.approx(1 / speed, rel=0.02)
    assert peak_frequency(out, rate) == pytest.approx(440.0, abs=2.0)  # a resample by the speed would move it


def test_chunked_output_is_the_whole_output_cut_where_the_chunks_were():
    rate = 22050
    source = np.random.default_rng(0).standard_normal(rate * 2).astype(np.float32) * 0.1
    whole = OutputAudio(rate, OPENAI_PCM_RATE, 2.0).whole(source)
    streamed = OutputAudio(rate, OPENAI_PCM_RATE, 2.0)
    pieces = [streamed.push(source[start:start + 2560]) for start in range(0, source.size, 2560)] + [streamed.finish()]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    plain = OutputAudio(rate, OPENAI_PCM_RATE).whole(source)  # speed 1.0: the resample alone, soxr's one-shot
    np.testing.assert_array_equal(plain, soxr.resample(source, rate, OPENAI_PCM_RATE))


# ---- the server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8, threads=1)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def base(service):
    with serving_on_loopback(create_app(lambda: service, ServerSettings(request_timeout=WAIT))) as port:
        yield f"http://127.0.0.1:{port}"


def post(base: str, **fields) -> httpx.Response:
    body = {"input": TEXT, "voice": "A", "seed": 7, "max_new_tokens": FRAMES, **fields}
    return httpx.post(base + "/v1/audio/speech", json=body, timeout=WAIT)


def int16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


@pytest.fixture(scope="module")
def take(base, service):
    """The take as the model made it: 16-bit samples at the model's rate, whole."""
    rate = service.processor.sampling_rate
    response = post(base, response_format="pcm", sample_rate=rate, stream=False)
    assert response.status_code == 200 and response.headers["x-sample-rate"] == str(rate)
    return int16(response.content), rate


def test_pcm_is_24_khz_the_take_resampled(base, take):
    samples, rate = take
    response = post(base, response_format="pcm")
    assert response.status_code == 200 and response.headers["x-sample-rate"] == str(OPENAI_PCM_RATE)
    np.testing.assert_allclose(int16(response.content), soxr.resample(samples, rate, OPENAI_PCM_RATE), atol=3 * LSB, rtol=0)


def test_sample_rate_sets_the_rate_of_pcm_and_wav(base, take):
    samples, rate = take
    as_wav = post(base, response_format="wav", sample_rate=16000, stream=False)
    audio, wav_rate = soundfile.read(io.BytesIO(as_wav.content), dtype="float32")
    assert wav_rate == 16000 and as_wav.headers["x-sample-rate"] == "16000"
    np.testing.assert_allclose(audio, soxr.resample(samples, rate, 16000), atol=3 * LSB, rtol=0)
    as_pcm = post(base, response_format="pcm", sample_rate=8000)
    np.testing.assert_allclose(int16(as_pcm.content), soxr.resample(samples, rate, 8000), atol=3 * LSB, rtol=0)
    default_wav = post(base, response_format="wav", stream=False)
    assert soundfile.info(io.BytesIO(default_wav.content)).samplerate == rate  # wav stays at the model's rate


def test_without_stream_fields_the_first_audio_leaves_while_the_take_is_still_being_made(base, service):
    body = {"input": TEXT + " " + TEXT, "voice": "A", "seed": 7, "max_new_tokens": 200, "response_format": "pcm"}
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=WAIT) as response:
        assert response.status_code == 200 and "x-finish-reason" not in response.headers
        chunks = response.iter_bytes()
        first = next(chunk for chunk in chunks if chunk)
        running_at_first_audio = service.engine.running
        rest = b"".join(chunks)
    assert first and rest and running_at_first_audio == 1  # the request was still generating
    whole = post(base, response_format="pcm", stream=False, **{k: v for k, v in body.items() if k != "response_format"})
    assert whole.headers["x-finish-reason"] in ("eos", "length")  # a whole take says how it ended
    np.testing.assert_allclose(int16(first + rest), int16(whole.content), atol=2 * LSB, rtol=0)


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_stretches_the_take_streamed_and_whole_alike(base, take, speed):
    samples, rate = take
    whole = int16(post(base, response_format="pcm", sample_rate=rate, speed=speed, stream=False).content)
    streamed = int16(post(base, response_format="pcm", sample_rate=rate, speed=speed).content)
    assert whole.size / samples.size == pytest.approx(1 / speed, rel=0.02)
    np.testing.assert_allclose(streamed, whole, atol=2 * LSB, rtol=0)


def test_every_response_carries_a_request_id(base):
    ids = set()
    for response in (post(base, response_format="pcm"), post(base, voice="nobody"), httpx.get(base + "/v1/nothing")):
        request_id = response.headers["x-request-id"]
        assert request_id.startswith("req_") and len(request_id) == 36
        ids.add(request_id)
    assert len(ids) == 3
    given = httpx.get(base + "/health", headers={"X-Request-Id": "client-42"})
    assert given.headers["x-request-id"] == "client-42"  # a client's own id is kept
    odd = httpx.get(base + "/health", headers={"X-Request-Id": "no spaces please"})
    assert odd.headers["x-request-id"].startswith("req_")


def test_sse_without_a_response_format_carries_mp3_as_openai_s_does(base, take):
    samples, rate = take
    response = post(base, stream_format="sse")
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    data = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name.startswith("mp3")
        decoded = sum(frame.samples for frame in container.decode(stream))
    assert 0 <= (decoded - samples.size) / rate <= 0.11  # the coder's padding, as for a whole mp3


def test_a_failure_before_the_first_audio_keeps_its_status_when_streaming(service):
    app = create_app(lambda: service, ServerSettings(request_timeout=0.001))
    with serving_on_loopback(app) as port:
        started = time.perf_counter()
        response = post(f"http://127.0.0.1:{port}", response_format="pcm")
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    assert time.perf_counter() - started < WAIT
