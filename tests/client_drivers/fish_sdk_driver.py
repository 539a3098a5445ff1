"""Drives `drama3 serve` with Fish Audio's official Python SDK (fish-audio-sdk), both of its clients
pointed at the server by their base URL: the current `fishaudio.FishAudio` (`tts.convert`,
`tts.stream`, `tts.stream_websocket`) and the legacy `fish_audio_sdk` (`Session.tts` read as it
streams, `Session.tts.awaitable` in asyncio, `WebSocketSession.tts`).

Run by tests/test_clients_fish.py with the Python of an environment where fish-audio-sdk is installed:
    python fish_sdk_driver.py '{"base_url": "http://...", "key": "...", "calls": [{"api": "convert", "text": "..."}]}'
A call names its "api" (convert, stream, websocket, legacy, legacy_async, legacy_websocket), its
"text" (the WebSocket calls: "pieces", each a text event), and may set "format", "sample_rate",
"reference_id", "speed", "key" (another key than the server's). Prints one JSON line: per call, the
audio as a player gets it (pcm: 16-bit mono at the rate the call asked for; else the file decoded:
its samples and rate), when its first bytes arrived and the call ended (seconds from its start),
and the exception the SDK raised (its class, module and status), if one was.
"""

import asyncio
import json
import sys
import time

import fish_audio_sdk
import fishaudio
from decoding import decoded_samples

DEFAULT_RATES = {"pcm": 44100}
"""The rate of pcm the call expects when it asks for none (Fish Audio's)."""


def chunks(base_url: str, key: str, call: dict):
    """The audio bytes of `call`, as the SDK hands them on."""
    api = call["api"]
    if api in ("convert", "stream", "websocket"):
        client = fishaudio.FishAudio(api_key=key, base_url=base_url)
        options = {name: call[name] for name in ("format", "reference_id", "speed") if call.get(name) is not None}
        config = fishaudio.TTSConfig(sample_rate=call.get("sample_rate"))
        if api == "convert":
            yield client.tts.convert(text=call["text"], config=config, **options)
        elif api == "stream":
            yield from client.tts.stream(text=call["text"], config=config, **options)
        else:
            yield from client.tts.stream_websocket(iter(call["pieces"]), config=config, **options)
        return
    fields = {name: call[name] for name in ("format", "sample_rate", "reference_id") if call.get(name) is not None}
    if call.get("speed") is not None:
        fields["prosody"] = fish_audio_sdk.Prosody(speed=call["speed"])
    if api == "legacy":
        yield from fish_audio_sdk.Session(key, base_url=base_url).tts(fish_audio_sdk.TTSRequest(text=call["text"], **fields))
    elif api == "legacy_async":
        yield asyncio.run(legacy_async(base_url, key, fish_audio_sdk.TTSRequest(text=call["text"], **fields)))
    else:
        with fish_audio_sdk.WebSocketSession(key, base_url=base_url) as session:
            yield from session.tts(fish_audio_sdk.TTSRequest(text="", **fields), iter(call["pieces"]))


async def legacy_async(base_url: str, key: str, request) -> bytes:
    """The legacy client's asyncio call, its stream gathered whole."""
    async with fish_audio_sdk.Session(key, base_url=base_url) as session:
        return b"".join([chunk async for chunk in session.tts.awaitable(request)])


def speak(base_url: str, key: str, call: dict) -> dict:
    started, first, data = time.perf_counter(), None, b""
    try:
        for piece in chunks(base_url, call.get("key", key), call):
            if piece and first is None:
                first = time.perf_counter() - started
            data += piece
    except Exception as error:  # the test checks which of the SDK's exceptions it is
        return {"api": call["api"], "errors": [f"{type(error).__name__}: {error}"],
                "exception": f"{type(error).__module__}.{type(error).__name__}",
                "status": getattr(error, "status", None)}
    ended = time.perf_counter() - started
    fmt = call.get("format") or "mp3"
    if fmt == "pcm":
        samples, rate = len(data) // 2, call.get("sample_rate") or DEFAULT_RATES["pcm"]
    else:
        samples, rate = decoded_samples(data)
    return {"api": call["api"], "format": fmt, "samples": samples, "rate": rate, "first_audio": first,
            "seconds": ended, "errors": []}


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps({"calls": [speak(request["base_url"], request["key"], call) for call in request["calls"]]}))
