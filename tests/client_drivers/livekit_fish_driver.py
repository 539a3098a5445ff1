"""Drives `drama3 serve` with LiveKit's Fish Audio plugin (`livekit.plugins.fishaudio.TTS`) pointed at
the server by its base URL: `synthesize(text)` (`POST /v1/tts`) and `stream()` (the `/v1/tts/live`
WebSocket, the plugin's sentences each sent with a flush), reading the audio frames as LiveKit
hands them on.

Run by tests/test_clients_fish.py with the Python of an environment where livekit-agents and
livekit-plugins-fishaudio are installed:
    python livekit_fish_driver.py '{"base_url": "http://...", "key": "...", "calls": [{"mode": "synthesize", "text": "..."}]}'
A call is "synthesize" (its "text") or "stream" (its "utterances": texts, each one `stream()` of the
same TTS, one after the other); it may set "output_format", "sample_rate", "voice_id", "speed" and
"key" (another key than the server's). Prints one JSON line: per utterance, the audio as LiveKit
plays it (samples, the rate of its frames), when its first frame arrived and the utterance ended
(seconds from its start), and the error if one was raised (its class and status code); per call,
how many WebSocket connections the plugin opened.
"""

import asyncio
import json
import sys
import time

import aiohttp
from livekit.agents import APIConnectOptions
from livekit.plugins import fishaudio

NO_RETRY = APIConnectOptions(max_retry=0, timeout=30)
"""One try per utterance: an error reaches the caller as LiveKit raises it."""


async def utterance(events, text: str | None) -> dict:
    """The frames of one synthesis (`text`: pushed into a stream, then its input ended)."""
    frames, first, error = [], None, None
    started = time.perf_counter()
    try:
        if text is not None:
            events.push_text(text)
            events.end_input()
        async with events:
            async for event in events:
                if first is None and event.frame.samples_per_channel:
                    first = time.perf_counter() - started
                frames.append(event.frame)
    except Exception as caught:  # the test checks which of LiveKit's exceptions it is
        error = caught
    rates = sorted({frame.sample_rate for frame in frames})
    report = {"samples": sum(frame.samples_per_channel for frame in frames),
              "rate": rates[0] if len(rates) == 1 else rates, "first_audio": first,
              "seconds": time.perf_counter() - started, "errors": []}
    if error is not None:
        report.update(errors=[f"{type(error).__name__}: {error}"], exception=type(error).__name__,
                      status=getattr(error, "status_code", None))
    return report


async def speak(base_url: str, key: str, call: dict, session: aiohttp.ClientSession) -> dict:
    options = {name: call[name] for name in ("output_format", "sample_rate", "voice_id", "speed") if call.get(name)}
    service = fishaudio.TTS(base_url=base_url, api_key=call.get("key", key), http_session=session, **options)
    connects = 0
    connect = service._connect_ws

    async def counted(timeout):  # how many sockets the plugin's pool opens
        nonlocal connects
        connects += 1
        return await connect(timeout)

    service._pool._connect_cb = counted
    if call["mode"] == "synthesize":
        utterances = [await utterance(service.synthesize(call["text"], conn_options=NO_RETRY), None)]
    else:
        utterances = [await utterance(service.stream(conn_options=NO_RETRY), text) for text in call["utterances"]]
    await service.aclose()
    return {"mode": call["mode"], "utterances": utterances, "connections": connects}


async def main(request: dict) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        return [await speak(request["base_url"], request["key"], call, session) for call in request["calls"]]


if __name__ == "__main__":
    print(json.dumps({"calls": asyncio.run(main(json.loads(sys.argv[1])))}))
