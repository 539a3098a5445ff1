"""The demo in a real browser: Debian's chromium, headless, driven by Playwright against the page on
loopback. A two-speaker scene with picked voices streams a take whose file is non-silent speech of
a plausible length; a director's note revises it into a second, different take; an empty script
shows the error naming the field. Screenshots are saved under the test's temporary folder."""

import base64
import io
import os

import numpy as np
import pytest
import soundfile

pytest.importorskip("gradio")
sync_api = pytest.importorskip("playwright.sync_api")

from transformers_drama3.decoding.budget import expected_seconds_of_text  # noqa: E402

CHROMIUM = "/usr/bin/chromium"  # Debian's package (installed by .ci/run); never a browser download
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run"]
SCENE = "<|speaker:0|> Did you hear that noise downstairs?\n<|speaker:1|> It is only the wind. Go back to sleep."
TAKE_SECONDS = 240 * 1000  # wait for a take at most this long (ms): a shared CPU can be slow
WINDOW = 0.05  # seconds per window when measuring how much of a take is voiced


@pytest.fixture(scope="module")
def page(demo_url):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (bash .ci/run does)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.goto(demo_url)
        yield page
        browser.close()


def pick_voice(page, speaker: int, voice: str) -> None:
    picker = page.locator(f"#voice-{speaker} input")
    picker.click()
    page.locator(f"#{picker.get_attribute('aria-controls')} li[aria-label='{voice}']").click()
    assert picker.input_value() == voice


FETCH_AUDIO = """async (player) => {
    const source = player.currentSrc || player.src;
    const bytes = new Uint8Array(await (await fetch(source)).arrayBuffer());
    let text = "";
    for (const byte of bytes) text += String.fromCharCode(byte);
    return [source, btoa(text)];
}"""
"""Fetch, inside the page, the audio an <audio> element plays; returns (its source, base64 bytes)."""


def final_take(page, previous_source: str | None = None) -> tuple[np.ndarray, str]:
    """(samples, source) of the final take's player once it plays a take other than `previous_source`."""
    player = page.locator("#final-take audio[src]").first
    player.wait_for(state="attached")
    page.wait_for_function(
        "([player, previous]) => player.src && player.src !== previous", arg=[player.element_handle(), previous_source]
    )
    source, encoded = player.evaluate(FETCH_AUDIO)
    samples, _ = soundfile.read(io.BytesIO(base64.b64decode(encoded)), dtype="float32")
    return samples, source


def voiced_fraction(samples: np.ndarray, rate: int) -> float:
    """The fraction of 50 ms windows louder than -40 dBFS."""
    size = int(WINDOW * rate)
    windows = samples[: samples.size // size * size].reshape(-1, size)
    return float(np.mean(np.sqrt(np.mean(windows**2, axis=1)) > 0.01))


@pytest.mark.slow
def test_a_scene_is_generated_revised_and_an_empty_script_refused_in_chromium(page, demo_backend, tmp_path):
    rate = demo_backend.service.processor.sampling_rate
    page.locator("#script textarea").fill(SCENE)
    pick_voice(page, 0, "B")
    pick_voice(page, 1, "A")
    page.locator("#generate").click()
    page.locator("#report", has_text="Take 1").wait_for(timeout=TAKE_SECONDS)
    page.locator("#stream audio").wait_for(state="attached")  # the streamed take's player
    first, source = final_take(page)
    seconds = first.size / rate
    expected = expected_seconds_of_text(SCENE)
    assert 0.3 * expected < seconds < 3 * expected, (seconds, expected)
    assert 0.3 < voiced_fraction(first, rate) < 0.98  # speech: mostly voiced, with pauses
    page.screenshot(path=str(tmp_path / "demo-take-1.png"), full_page=True)

    page.locator("#revision-note textarea").fill("slower, more tired")
    page.locator("#revise").click()
    page.locator("#report", has_text="Take 2").wait_for(timeout=TAKE_SECONDS)
    second, _ = final_take(page, source)
    assert second.shape != first.shape or not np.array_equal(first, second)
    assert voiced_fraction(second, rate) > 0.3
    page.screenshot(path=str(tmp_path / "demo-take-2.png"), full_page=False)

    page.locator("#script textarea").fill("")
    page.locator("#generate").click()
    page.get_by_text("Script: nothing to say").first.wait_for(timeout=30_000)
    page.screenshot(path=str(tmp_path / "demo-empty-script.png"))
    assert (tmp_path / "demo-take-2.png").stat().st_size > 10_000
