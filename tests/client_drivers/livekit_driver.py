"""Drives `drama3 serve` with LiveKit's OpenAI plugin (`livekit.plugins.openai.TTS`): its
`synthesize(text)`, and `stream()` through LiveKit's `tts.StreamAdapter` (how an agent session
streams a TTS that is not a streaming one), reading the audio frames as LiveKit hands them on.

Run by tests/test_clients.py with the Python of an environment where livekit-agents and
livekit-plugins-openai are installed:
    python livekit_driver.py '{"base_url": ".../v1", "calls": [{"mode": "synthesize", "voice": null, "text": "..."}]}'
A call may name "response_format" (LiveKit's own default: mp3) and "speed". Prints one JSON line: per call, the
audio as LiveKit plays it (samples, the rate of its frames), when its first frame arrived and the
call ended (seconds from its start), the request ids LiveKit reports, and the error if one was raised.
"""

import asyncio
import json
import sys
import time

from livekit.agents import tts as agents_tts
from livekit.plugins import openai


async def speak(base_url: str, call: dict) -> dict:
    options = {key: call[key] for key in ("voice", "response_format", "speed") if call.get(key)}
    service = openai.TTS(base_url=base_url, api_key="none", **options)
    frames, request_ids, first, error = [], set(), None, None
    started = time.perf_counter()
    try:
        if call["mode"] == "synthesize":
            events = service.synthesize(call["text"])
        else:
            events = agents_tts.StreamAdapter(tts=service).stream()
            events.push_text(call["text"])
            events.end_input()
        async with events:
            async for event in events:
                if first is None and event.frame.samples_per_channel:
                    first = time.perf_counter() - started
                frames.append(event.frame)
                request_ids.add(event.request_id)
    except Exception as caught:  # the test reports what LiveKit raised
        error = f"{type(caught).__name__}: {caught}"
    ended = time.perf_counter() - started
    await service.aclose()
    rates = sorted({frame.sample_rate for frame in frames})
    return {"voice": service._opts.voice, "samples": sum(frame.samples_per_channel for frame in frames),
            "rate": rates[0] if len(rates) == 1 else rates, "first_audio": first, "seconds": ended,
            "request_ids": sorted(request_ids), "errors": [error] if error else []}


async def main(request: dict) -> list[dict]:
    return [await speak(request["base_url"], call) for call in request["calls"]]


if __name__ == "__main__":
    print(json.dumps({"calls": asyncio.run(main(json.loads(sys.argv[1])))}))
