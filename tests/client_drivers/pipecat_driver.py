"""Drives `drama3 serve` with pipecat's OpenAITTSService through pipecat's own test harness
(`pipecat.tests.utils.run_test`): one TTSSpeakFrame per call, in a pipeline of its own.

Run by tests/test_clients.py with the Python of an environment where pipecat-ai[openai] is installed:
    python pipecat_driver.py '{"base_url": ".../v1", "calls": [{"voice": null, "text": "...", "speed": 1.5}]}'
Prints one JSON line: per call, the audio as pipecat plays it (samples, the rate its frames say), when
the first audio frame arrived and the call ended (seconds from its start), and every error frame.
"""

import asyncio
import json
import sys
import time

from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.tests.utils import run_test


class FirstAudio(BaseObserver):
    """When the TTS service pushed its first audio frame."""

    def __init__(self, service, **kwargs):
        super().__init__(**kwargs)
        self.service, self.at = service, None

    async def on_push_frame(self, data: FramePushed):
        if self.at is None and data.source is self.service and isinstance(data.frame, TTSAudioRawFrame):
            self.at = time.perf_counter()


async def speak(base_url: str, voice, text: str, speed=None) -> dict:
    chosen = {key: value for key, value in (("voice", voice), ("speed", speed)) if value}
    settings = OpenAITTSService.Settings(**chosen) if chosen else None  # None: pipecat's defaults
    service = OpenAITTSService(api_key="none", base_url=base_url, settings=settings)
    first = FirstAudio(service)
    started = time.perf_counter()
    down, up = await run_test(service, frames_to_send=[TTSSpeakFrame(text)], observers=[first], start_timeout=30)
    ended = time.perf_counter()
    audio = [frame for frame in down if isinstance(frame, TTSAudioRawFrame)]
    errors = [str(frame.error) for frame in [*down, *up] if isinstance(frame, ErrorFrame)]
    rates = sorted({frame.sample_rate for frame in audio})
    return {"voice": service._settings.voice, "samples": sum(len(frame.audio) // 2 for frame in audio),
            "rate": rates[0] if len(rates) == 1 else rates, "first_audio": None if first.at is None else first.at - started,
            "seconds": ended - started, "errors": errors}


async def main(request: dict) -> list[dict]:
    return [await speak(request["base_url"], call.get("voice"), call["text"], call.get("speed"))
            for call in request["calls"]]


if __name__ == "__main__":
    print(json.dumps({"calls": asyncio.run(main(json.loads(sys.argv[1])))}))
