"""The demo's API endpoints with gradio_client, as a script would call them (no browser): a take
streams and ends in a WAV file, the same seed gives the same take, a revision gives a second
and different take, and bad input comes back as the error message naming its field."""

import numpy as np
import pytest
import soundfile

pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from transformers_drama3.serving.director import TAKE_OPTIONS  # noqa: E402

SCENE = "<|speaker:0|> Good morning to you. <|speaker:1|> Hello there."
VOICES = ["A", None, "", "B", None, "", "B", None, "", "A", None, ""]  # (voice, clip, transcript) per speaker
# preset, then the sampling panel's fields in the option schema's order: seed 5, max frames 24, the others empty
SAMPLING = ["model default", *({"seed": 5, "max_new_tokens": 24}.get(option.name) for option in TAKE_OPTIONS)]


@pytest.fixture(scope="module")
def client(demo_url):
    """One client session for the module: its takes are kept server-side, so /revise revises them."""
    return gradio_client.Client(demo_url, verbose=False)


def generate(client, text=SCENE, note="", sampling=SAMPLING, voices=VOICES):
    job = client.submit(text, note, *sampling, *voices, api_name="/generate")
    job.result(timeout=240)
    return job.outputs()


def take_of(outputs) -> tuple[np.ndarray, int, str]:
    """(samples, rate, report) of the final take: the last update names its file and report."""
    _, path, report = outputs[-1]
    samples, rate = soundfile.read(path, dtype="float32")
    return samples, rate, report


def test_the_api_names_its_two_endpoints(client):
    assert {"/generate", "/revise"} <= set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])


@pytest.fixture(scope="module")
def first_take(client):
    """The outputs of one /generate call of SCENE with seed 5."""
    return generate(client)


@pytest.mark.slow
def test_a_take_streams_chunks_then_ends_in_a_non_silent_wav(first_take):
    outputs = first_take
    streamed = [stream for stream, _, _ in outputs[:-1] if isinstance(stream, str)]
    assert streamed and all(path.endswith(".m3u8") for path in streamed)  # the stream's playlist
    samples, rate, report = take_of(outputs)
    assert rate == 22050 and 0.5 < samples.size / rate < 10
    assert np.sqrt(np.mean(samples**2)) > 0.01
    assert report.startswith("**Take 1**") and "seed 5" in report and "real-time factor" in report


@pytest.mark.slow
def test_the_same_seed_gives_the_same_take(client, first_take):
    first, _, _ = take_of(first_take)
    second, _, _ = take_of(generate(client))
    np.testing.assert_array_equal(first, second)


@pytest.mark.slow
def test_revising_gives_a_second_different_take(client, first_take):
    first, _, _ = take_of(first_take)  # the session's last take is this one, or its twin of the same seed
    job = client.submit("slower, more tired", *SAMPLING, api_name="/revise")
    job.result(timeout=240)
    second, _, report = take_of(job.outputs())
    assert report.startswith("**Take 2**")
    assert second.shape != first.shape or not np.array_equal(first, second)


def test_revising_before_any_take_names_the_revision_note(demo_url):
    fresh = gradio_client.Client(demo_url, verbose=False)  # a new session has no take
    with pytest.raises(gradio_client.exceptions.AppError, match="^Revision note: there is no take"):
        fresh.predict("slower", *SAMPLING, api_name="/revise")


@pytest.mark.parametrize(
    ("text", "voices", "field"),
    [
        ("", VOICES, "Script: nothing to say"),
        ("<|speaker:9|> Hi.", VOICES, "Script: speaker 9 has no voice"),
        ("<|speaker:1|> Hi.", ["A", None, "", "my clip", None, "", *VOICES[6:]], "Speaker 1 clip:"),
    ],
    ids=["empty script", "unknown speaker", "own voice without a clip"],
)
def test_bad_input_comes_back_as_the_message_naming_its_field(client, text, voices, field):
    with pytest.raises(gradio_client.exceptions.AppError) as raised:
        client.predict(text, "", *SAMPLING, *voices, api_name="/generate")
    assert raised.value.message.startswith(field)


@pytest.mark.slow
def test_concurrent_users_each_get_their_own_take(demo_url):
    """Three sessions ask for the same take at once: they share the engine's batch, and their
    streams carry equal chunks, which must not collide on the way to the page."""
    clients = [gradio_client.Client(demo_url, verbose=False) for _ in range(3)]
    sampling = ["model default", *({"seed": 11, "max_new_tokens": 16}.get(option.name) for option in TAKE_OPTIONS)]
    jobs = [client.submit("Hello there.", "", *sampling, *VOICES, api_name="/generate") for client in clients]
    reports = [job.result(timeout=240)[2] for job in jobs]
    assert all(report.startswith("**Take 1**") and "seed 11" in report for report in reports)
    paths = [job.result()[1] for job in jobs]
    assert len(set(paths)) == 3 and all(soundfile.info(path).frames > 0 for path in paths)
