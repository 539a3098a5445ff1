"""Fish Audio's TTS API mapped onto the server's own speech request (`protocol.SpeechParams`).

The clients written against Fish Audio's cloud (fish-audio-sdk's `fishaudio` and legacy
`fish_audio_sdk`, LiveKit's `livekit-plugins-fishaudio`) send one request shape, as a MessagePack
(or JSON) body to `POST /v1/tts` and as the `request` of the `start` event of `/v1/tts/live`:

    {"text", "format", "sample_rate", "mp3_bitrate", "opus_bitrate", "references": [{"audio", "text"}],
     "reference_id", "latency", "prosody": {"speed", "volume"}, "temperature", "top_p", "max_new_tokens",
     "chunk_length", ...}

and the model's name in a `model` header. `fish_speech(...)` (HTTP) and `fish_live_start(...)`
(the WebSocket's `start`) map it, field by field, onto what `/v1/audio/speech` would have been
asked (`fish_options`), so both doors speak through the same engine, voices and checks:

| Fish Audio | the server's request |
|---|---|
| `text` | `input` (HTTP; the live route's text arrives in `text` events) |
| `reference_id` | `voice`: a stored voice, an adapter voice or an alias; Fish's default voice id speaks the default voice |
| `references` `[{audio: bytes, text}]` | `references`, each clip's bytes read as a file (base64 in JSON) |
| `format` wav / pcm / mp3 / opus | `response_format`, always streamed (`stream_format` "audio") |
| `sample_rate` (default 44100; opus 48000) | `sample_rate`, for every format (mp3 at an MPEG rate) |
| `mp3_bitrate` kbps, `opus_bitrate` kbps / bps / -1000 | `bit_rate` (bits per second; -1000: the encoder's choice) |
| `prosody.speed`, `prosody.volume` (dB) | `speed` (the same time stretch), `volume_db` |
| `latency` normal / balanced / low | `first_window`: frames of the first audio chunk (10 / 5 / 2) |
| `temperature`, `top_p`, `max_new_tokens` | the same request options (0 frames: the server's default) |
| `chunk_length` | the text stream's chunk size in bytes (live route; HTTP speaks the whole text as one take) |
| `seed` and the other request options (drama3's extensions) | the same options (`decoding.options`, HTTP's) |

`IGNORED` fields have no meaning for Drama 3 and are accepted with any value, as are unknown keys;
a null is the field's default. `sample_rate` and `prosody.speed` are checked by the option
schema's entries of the same options (`decoding.options`: `sample_rate`, `speed`), `format` is one
of the `response_format` entry's choices. Every problem is an `ApiError` naming the field, answered
in Fish Audio's error shape on these routes (`error_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ..decoding import HTTP
from .audio_formats import supported_formats
from .json_bounds import JsonBounds
from .msgpack_bounds import msgpack_cost
from .output_audio import can_stretch
from .protocol import (
    JSON_BOUNDS,
    ApiError,
    Limits,
    SpeechParams,
    _number,
    _string,
    check_speakable,
    load_json,
    option_value,
    parse_references,
    request_options,
    unicode_text,
)

MODEL_NAMES = ("s1", "s1-mini", "s2-pro", "s2.1-pro", "speech-1.5", "speech-1.6", "agent-x0", "drama-3")
"""Fish Audio's model names (the `model` header) the server answers as aliases of the served model."""
DEFAULT_VOICE_IDS = ("933563129e564b19a115bedd57b7406a",)
"""Fish Audio voice ids that speak the server's default voice unless a voice of that id is stored:
the one LiveKit's plugin sends when no voice is set (so it works by base URL alone)."""
FORMATS = ("wav", "pcm", "mp3", "opus")
"""Fish Audio's formats: four of the option schema's `response_format` choices."""
DEFAULT_FORMAT = "mp3"
DEFAULT_RATES = {"wav": 44100, "pcm": 44100, "mp3": 44100, "opus": 48000}
"""Fish Audio's rate of each format when a request gives none."""
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
"""The rates an MP3 stream can have (MPEG-1, 2 and 2.5)."""
OPUS_RATE = 48000
MP3_KBPS = (32, 320)
OPUS_KBPS = (6, 510)
"""Opus's bitrates in kbps; the SDK sends kbps, LiveKit bits per second (the ranges cannot overlap)."""
OPUS_AUTO = -1000
VOLUME_DB = (-20.0, 20.0)
LATENCY_FIRST_WINDOW = {"normal": None, "balanced": 5, "low": 2}
"""Frames of a stream's first audio chunk per latency mode (None: the codec's schedule, 10 frames)."""
CHUNK_BYTES = (8, 1200)
"""`chunk_length`: the text stream's chunk size in bytes (its own bounds, `chunk_bytes`)."""
IGNORED = ("normalize", "min_chunk_length", "condition_on_previous_chunks", "early_stop_threshold", "features",
           "repetition_penalty", "prosody.normalize_loudness")
"""Fields with no meaning for Drama 3: accepted, whatever their value (no repetition penalty:
Drama 3 has repetition-aware sampling, a setting of the model's generation config)."""
MSGPACK_BOUNDS = JSON_BOUNDS
"""A MessagePack body is held to a JSON body's bounds: 32 levels, 10,000 items, 2,000 keys."""
MEDIA_MSGPACK = "application/msgpack"
MEDIA_JSON = "application/json"


@dataclass
class FishRequest:
    """A mapped Fish Audio request: `speech`, what `/v1/audio/speech` would have been asked (its
    input empty for the live route), and `chunk_bytes`, the text stream's chunk size
    (`chunk_length`; None: the published ~300 bytes)."""

    speech: SpeechParams
    chunk_bytes: int | None = None


def load_msgpack(raw: bytes, location: str | None = None, bounds: JsonBounds = MSGPACK_BOUNDS):
    """A MessagePack body or message -> its value; ApiError 400 when it passes `bounds` (counted
    from the bytes by `msgpack_bounds.msgpack_cost` before anything is unpacked), is not
    MessagePack, holds a string that is not UTF-8, or a map key that is not a string. Slow for a
    large body: call it off the event loop."""
    where = location or "the body"
    cost = msgpack_cost(raw, bounds)
    if cost.over is not None:
        raise ApiError(400, f"{where}: {cost.over}", location)
    limit = len(raw)
    try:  # the length limits are the walk's bound again, should the two ever disagree
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=limit, max_bin_len=limit,
                               max_array_len=bounds.items, max_map_len=bounds.keys, max_ext_len=0)
    except UnicodeDecodeError as error:
        raise ApiError(400, f"{where}: a string is not UTF-8 (byte {error.start} of it)", location) from None
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ApiError(400, f"{where}: not MessagePack ({type(error).__name__})", location) from None


def media_loader(content_type: str | None):
    """The loader of a `/v1/tts` body of this Content-Type: `load_msgpack` for
    `application/msgpack` (what the clients send), `protocol.load_json` for JSON; ApiError 415 for
    any other type (a form or text/plain, which a page may send cross-site without asking first,
    never acts)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media in (MEDIA_MSGPACK, "application/x-msgpack"):
        return load_msgpack
    if media == MEDIA_JSON:
        return load_json
    shown = "none" if content_type is None else repr(content_type[:61] + "..." if len(content_type) > 64 else content_type)
    raise ApiError(415, f"Content-Type {shown}: expected {MEDIA_MSGPACK} or {MEDIA_JSON}", None,
                   "unsupported_media_type")


def check_model(model: str | None, served: str) -> None:
    """The `model` header: absent, the served model's name, or one of Fish Audio's (`MODEL_NAMES`)."""
    if model is None or model in MODEL_NAMES or model == served:
        return
    shown = model if len(model) <= 64 else model[:61] + "..."
    raise ApiError(400, f"model: {shown!r} is not served here; one of {[served, *MODEL_NAMES]}", "model")


def fish_speech(body, model: str | None, served: str, limits: Limits, is_voice) -> FishRequest:
    """`POST /v1/tts`: a Fish Audio request (a map), its `model` header and the served model's
    name -> the speech request it asks for. `is_voice(id)`: whether a voice is registered."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a map (a MessagePack map or a JSON object)")
    text = _string(body, "text", required=True)
    check_speakable(text, "text")
    if len(text) > limits.max_input_chars:
        raise ApiError(413, f"text: {len(text)} characters; at most {limits.max_input_chars}", "text")
    return fish_options(body, text, model, served, limits, is_voice)


def fish_live_start(event, model: str | None, served: str, limits: Limits, is_voice) -> FishRequest:
    """The live route's `{"event": "start", "request": {...}}` -> the speech request of the
    utterance it starts (its text, if any, is the utterance's first piece: `speech.input`)."""
    request = event.get("request") if isinstance(event, dict) else None
    if not isinstance(request, dict):
        raise ApiError(400, "request: the start event carries the request as a map", "request")
    text = _string(request, "text") or ""
    if len(text) > limits.max_input_chars:
        raise ApiError(413, f"text: {len(text)} characters; at most {limits.max_input_chars}", "text")
    return fish_options(request, text, model, served, limits, is_voice)


def fish_options(body: dict, text: str, model: str | None, served: str, limits: Limits, is_voice) -> FishRequest:
    """The one mapping of a Fish Audio request's fields onto the server's request (module docstring)."""
    check_model(model, served)
    response_format = _string(body, "format") or DEFAULT_FORMAT
    if response_format not in FORMATS:
        raise ApiError(400, f"format: {response_format!r}; expected one of {list(FORMATS)}", "format")
    if response_format not in supported_formats():
        raise ApiError(400, f"format: {response_format!r} cannot be written on this server (PyAV is missing); "
                            f"supported: {[name for name in FORMATS if name in supported_formats()]}", "format")
    prosody = body.get("prosody")
    if prosody is not None and not isinstance(prosody, dict):
        raise ApiError(400, f"prosody: expected a map of speed and volume; got {type(prosody).__name__}", "prosody")
    prosody = prosody or {}
    speed = option_value(prosody, "speed", "prosody.")  # the speech route's `speed`, checked by its entry
    if speed is not None and speed != 1.0 and not can_stretch():
        raise ApiError(400, f"prosody.speed: {speed} needs PyAV on the server (the [serve] extra); only 1.0 here",
                       "prosody.speed")
    volume = _number({"prosody.volume": prosody.get("volume")}, "prosody.volume", *VOLUME_DB)
    latency = _string(body, "latency") or "normal"
    if latency not in LATENCY_FIRST_WINDOW:
        raise ApiError(400, f"latency: {latency!r}; expected one of {list(LATENCY_FIRST_WINDOW)}", "latency")
    max_new_tokens = _number(body, "max_new_tokens", 0, limits.max_new_tokens, integer=True)
    speech = SpeechParams(
        model=model,
        input=text,
        voice=_voice(body, is_voice),
        instructions=None,
        response_format=response_format,
        stream_format="audio",
        references=parse_references(body.get("references") or None, limits, is_voice),
        options=request_options({**body, "max_new_tokens": max_new_tokens or None}, HTTP, limits),  # Fish's 0: the default
        speed=1.0 if speed is None else float(speed),
        sample_rate=_sample_rate(body, response_format),
        volume_db=0.0 if volume is None else float(volume),
        bit_rate=_bit_rate(body, response_format),
        first_window=LATENCY_FIRST_WINDOW[latency],
    )
    return FishRequest(speech, _number(body, "chunk_length", *CHUNK_BYTES, integer=True))


def _voice(body: dict, is_voice) -> str | None:
    """`reference_id` -> the voice id (None: the default voice)."""
    voice = body.get("reference_id")
    if voice in (None, ""):
        return None
    if not isinstance(voice, str):
        raise ApiError(400, f"reference_id: expected a voice id (a string); got {type(voice).__name__}", "reference_id")
    voice = unicode_text(voice, "reference_id")
    if voice in DEFAULT_VOICE_IDS and not is_voice(voice):
        return None
    return voice


def _sample_rate(body: dict, response_format: str) -> int:
    """`sample_rate`, checked for its format; Fish Audio's default for the format when absent."""
    rate = option_value(body, "sample_rate")
    if rate is None:
        return DEFAULT_RATES[response_format]
    if response_format == "mp3" and rate not in MP3_RATES:
        raise ApiError(400, f"sample_rate: {rate} is not a rate of MP3; one of {list(MP3_RATES)}", "sample_rate")
    if response_format == "opus" and rate != OPUS_RATE:
        raise ApiError(400, f"sample_rate: Opus is sent at {OPUS_RATE}; got {rate}", "sample_rate")
    return rate


def _bit_rate(body: dict, response_format: str) -> int | None:
    """The bits per second of mp3 (`mp3_bitrate`, kbps) or opus (`opus_bitrate`: kbps as the SDK
    sends it, bits per second as LiveKit does, or -1000 for the encoder's choice); both fields are
    checked, the format's is used. None: the encoder's default."""
    mp3 = _number(body, "mp3_bitrate", *MP3_KBPS, integer=True)
    opus = body.get("opus_bitrate")
    if opus is not None and opus != OPUS_AUTO:
        if isinstance(opus, bool) or not isinstance(opus, int) or not (
                OPUS_KBPS[0] <= opus <= OPUS_KBPS[1] or 1000 * OPUS_KBPS[0] <= opus <= 1000 * OPUS_KBPS[1]):
            raise ApiError(400, f"opus_bitrate: {opus!r}; expected {OPUS_AUTO} (automatic), kbps in "
                                f"[{OPUS_KBPS[0]}, {OPUS_KBPS[1]}] or bits per second in "
                                f"[{1000 * OPUS_KBPS[0]}, {1000 * OPUS_KBPS[1]}]", "opus_bitrate")
        opus = opus * 1000 if opus <= OPUS_KBPS[1] else opus
    if response_format == "mp3" and mp3 is not None:
        return mp3 * 1000
    if response_format == "opus" and opus not in (None, OPUS_AUTO):
        return opus
    return None
