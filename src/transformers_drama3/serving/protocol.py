"""The request bodies of the OpenAI-compatible API, checked field by field.

`POST /v1/audio/speech` takes OpenAI's fields (`model`, `input`, `voice`, `instructions`,
`response_format`, `speed`, `stream_format`), the `sample_rate` extension Speaches and
Kokoro-FastAPI accept, SGLang-Omni's extensions (`references`, `stream`) and the request options
of the option schema offered over HTTP (`decoding.options`: `seed`, `temperature`, `top_p`,
`top_k`, `max_new_tokens`, ...; read by `request_options`, one field per entry, each checked by the
schema's one check). `voice`, `response_format`, `speed` and `sample_rate` are the schema's too (the
server's own entries, `decode=False`): `option_value` checks each by its entry, and the door adds
only what the server alone knows (a format this server cannot encode, a rate that does not apply
to the format, a speed without PyAV). As OpenAI does, the audio is streamed unless the request says
`stream: false`, and `response_format` defaults to mp3. Every problem is an `ApiError` with
the status and OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`, naming the
field, raised before any work is done.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass, field

from ..decoding import HTTP, OPTIONS, STREAM, options_for
from .audio_formats import STREAMABLE, supported_formats
from .error_shapes import error_body
from .json_bounds import JsonBounds, json_cost
from .output_audio import can_stretch
from .voices import VoiceReference, read_audio_bytes

STREAM_FORMATS = ("audio", "sse")
RESPONSE_FORMAT = OPTIONS["response_format"]
OPENAI_FORMATS = RESPONSE_FORMAT.choices
"""Every `response_format` the protocol knows (the schema entry's choices)."""
RATE_FORMATS = ("pcm", "wav")
"""The formats a request's `sample_rate` applies to (the others are coded at the model's rate)."""
JSON_BOUNDS = JsonBounds()
"""How much JSON a request body or message may make the server build: 32 levels deep (the API's own
bodies nest 4), 10,000 items, 2,000 keys."""
MAX_JSON_DEPTH = JSON_BOUNDS.depth
MAX_NUMBER_DIGITS = 40
"""Longer integer literals are not converted (a 5,000-digit one costs time and fails Python's limit)."""


MAX_MESSAGE_CHARS = 400
"""Longer error messages keep their start and end (a long input echoed whole is left out)."""
_SERVER_PATH = re.compile(r"(?<![\w/:.~-])/(?:[^\s/'\"(),:;<>]+/)+[^\s/'\"(),:;<>]*")
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-f]+>")


def public_message(message: str) -> str:
    """An error message fit for a client: an absolute path of the server's disk cut to its last
    part, no Python object reprs, at most `MAX_MESSAGE_CHARS` characters (the middle left out)."""
    message = _SERVER_PATH.sub(lambda path: path.group().rstrip("/").rsplit("/", 1)[-1] or "/", message)
    message = _OBJECT_REPR.sub("the data", message)
    if len(message) > MAX_MESSAGE_CHARS:
        left_out = len(message) - MAX_MESSAGE_CHARS + 40
        message = f"{message[:240]} [... {left_out} characters left out ...] {message[-120:]}"
    return message


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
             413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        message = public_message(message)
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.param = param if param is None or len(param) <= 64 else param[:61] + "..."
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self, path: str | None = None) -> dict:
        """The error's JSON body as the route at `path` answers it (`error_shapes`: OpenAI's shape,
        Fish Audio's on its routes)."""
        return error_body(path, self.status, self.message, self.TYPES.get(self.status, "server_error"), self.param,
                          self.code)


RETRY_AFTER_SECONDS = 1
"""What a 429 asks the client to wait (`Retry-After`): a slot frees as soon as one request ends."""


def damaged_adapter(voice_id: str, error: Exception) -> ApiError:
    """The 409 of a request for an adapter voice whose folder no longer loads (changed on disk)."""
    return ApiError(409, f"voice: the fine-tuned voice {voice_id!r} cannot be loaded ({error}); register it again",
                    "voice", "voice_damaged")


class LongNumber:
    """An integer literal of more than `MAX_NUMBER_DIGITS` digits, left unconverted; the field that
    holds it is refused by name when it is read."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"a {self.digits}-digit number"


def _integer(text: str):
    return int(text) if len(text) <= MAX_NUMBER_DIGITS else LongNumber(text)


def load_json(raw, location: str | None = None, bounds: JsonBounds = JSON_BOUNDS):
    """A request body (`location` None) or message (bytes or str) -> its JSON value; an ApiError (400)
    for text that is not UTF-8 JSON, or whose parse would pass `bounds` (nesting depth, items,
    keys: counted from the bytes by `json_bounds.json_cost` before anything is parsed). Long
    integers stay `LongNumber`s and NaN / Infinity stay floats: the field that holds one is
    refused by name. Slow for a large body (a scan, then a parse): call it off the event loop."""
    where = location or "the body"
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if not isinstance(raw, str) and json.detect_encoding(data) not in ("utf-8", "utf-8-sig"):
        raise ApiError(400, f"{where}: not JSON in UTF-8", location)  # UTF-16's bytes would hide brackets from the count
    cost = json_cost(data, bounds)
    if cost.over is not None:
        raise ApiError(400, f"{where}: {cost.over}", location)
    try:
        return json.loads(raw, parse_int=_integer)
    except RecursionError:  # not reached within the depth bound; kept for a bound set past the parser's stack
        raise ApiError(400, f"{where}: nested too deeply", location) from None
    except ValueError as error:  # not JSON, or not UTF-8
        raise ApiError(400, f"{where}: not JSON ({error})", location) from None


def unicode_text(value: str, location: str) -> str:
    """`value` if it can be written as UTF-8; a lone surrogate (JSON's "\\ud800") is refused by name."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(
            400, f"{location}: character {error.start} is a lone surrogate (U+{ord(value[error.start]):04X}); "
            "expected valid Unicode text", location,
        ) from None
    return value


@dataclass
class Limits:
    """What one request may ask for."""

    max_input_chars: int = 4096
    max_new_tokens: int = 4096
    max_references: int = 8
    max_reference_bytes: int = 10 * 2**20


@dataclass
class SpeechParams:
    """A checked speech request. voice: a voice id or None; references: inline references;
    stream_format: "audio" or "sse", None for the whole take in one body (`stream: false`);
    options: the request options it gives (name -> value, the schema's entries offered over HTTP,
    checked; `seed`, `temperature`, `max_new_tokens`, ...); speed: the time-stretch factor (1.0: as
    spoken); sample_rate: the rate asked for pcm or wav (None: the format's own,
    `output_audio.output_rate`). Set by Fish Audio's door (`fish_protocol`) only: volume_db, a gain
    in decibels; bit_rate, bits per second of a lossy format (None: the encoder's default);
    first_window, frames of a stream's first audio chunk (None: the codec's schedule)."""

    model: str | None
    input: str
    voice: str | None
    instructions: str | None
    response_format: str
    stream_format: str | None
    references: list = field(default_factory=list)
    options: dict = field(default_factory=dict)
    speed: float = 1.0
    sample_rate: int | None = None
    volume_db: float = 0.0
    bit_rate: int | None = None
    first_window: int | None = None

    @property
    def seed(self) -> int | None:
        return self.options.get("seed")


def _number(body: dict, name: str, low: float, high: float, integer: bool = False, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, LongNumber):
        raise ApiError(400, f"{name}: {value!r} is outside [{low}, {high}]", name)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"{name}: expected {'an integer' if integer else 'a number'}; got {value!r}", name)
    if not math.isfinite(value):  # NaN passes every comparison
        raise ApiError(400, f"{name}={value!r}; expected a finite number in [{low}, {high}]", name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ApiError(400, f"{name}: {value!r} is outside {bracket}{low}, {high}]", name)
    return value


def _string(body: dict, name: str, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name}: this field is required", name)
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{name}: expected a string; got {type(value).__name__}", name)
    return unicode_text(value, name)


def option_value(body: dict, name: str, where: str = ""):
    """The value `body` gives the option schema's entry `name` (`decoding.options.OPTIONS`),
    checked by the entry's one check (`Option.check`: its type, range or choices): None when absent
    or null; otherwise an ApiError (400) naming the field (`where` + name: "prosody.speed").
    A string is also held to valid Unicode."""
    option, value = OPTIONS[name], body.get(name)
    try:
        option.check(value, where)
    except ValueError as error:
        raise ApiError(400, str(error), where + name) from None
    return unicode_text(value, where + name) if isinstance(value, str) else value


def parse_voice(value) -> str | None:
    """`voice`: a voice id (the schema's entry), or `{"id": ...}` (OpenAI's custom-voice spelling).
    Whether the voice exists is the server's check."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if value == "" or not OPTIONS["voice"].accepts(value):
        raise ApiError(400, f"voice: expected a voice id or {{\"id\": ...}}; got {value!r}", "voice")
    return unicode_text(value, "voice")


def decode_audio_field(value, location: str, limits: Limits, voice_ids: bool = True) -> tuple:
    """Base64 audio (optionally a `data:` URL), or the file's bytes themselves (a MessagePack
    binary: Fish Audio's `references`) -> (samples, rate). `voice_ids`: whether the field could
    also have named a registered voice (the error says so only then)."""
    if isinstance(value, (bytes, bytearray)) and value:
        if len(value) > limits.max_reference_bytes:
            raise ApiError(413, f"{location}: the audio is over {limits.max_reference_bytes} bytes", location)
        try:
            return read_audio_bytes(bytes(value), location)
        except ValueError as error:
            raise ApiError(400, str(error), location) from None
    if not isinstance(value, str) or not value:
        expected = "base64 audio or a registered voice id" if voice_ids else "base64 audio"
        raise ApiError(400, f"{location}: expected {expected}", location)
    if value.startswith("data:"):
        value = value.partition(",")[2]
    if len(value) * 3 // 4 > limits.max_reference_bytes:
        raise ApiError(413, f"{location}: the audio is over {limits.max_reference_bytes} bytes", location)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        problem = "not valid base64 audio, nor a registered voice id" if voice_ids else "not valid base64 audio"
        raise ApiError(400, f"{location}: {problem}", location) from None
    try:
        return read_audio_bytes(data, location)
    except ValueError as error:
        raise ApiError(400, str(error), location) from None


def parse_references(value, limits: Limits, is_voice) -> list:
    """`references`: [{"audio": base64 | voice id, "text", "speaker"}] -> a list of VoiceReference
    or ("voice", id, speaker) entries; `is_voice` None: voice ids are not accepted (a new voice)."""
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise ApiError(400, "references: expected a non-empty list of {\"audio\", \"text\", \"speaker\"}", "references")
    if len(value) > limits.max_references:
        raise ApiError(413, f"references: {len(value)} references; at most {limits.max_references}", "references")
    references = []
    for index, item in enumerate(value):
        location = f"references[{index}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{location}: expected an object with audio and text", location)
        speaker = _number(item, "speaker", 0, 15, integer=True)
        speaker = 0 if speaker is None else speaker
        audio = item.get("audio")
        if is_voice is not None and isinstance(audio, str) and is_voice(audio):
            references.append(("voice", audio, speaker))
            continue
        text = item.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, f"{location}.text: the transcript of the reference audio is required", f"{location}.text")
        check_speakable(unicode_text(text, f"{location}.text"), f"{location}.text")  # a transcript as the input
        samples, rate = decode_audio_field(audio, f"{location}.audio", limits, voice_ids=is_voice is not None)
        references.append(VoiceReference(samples, rate, text, speaker))
    return references


def speakable(text: str) -> bool:
    """Whether `text` holds a letter or digit (emoji, symbols, controls and invisible characters
    alone give the model nothing to say)."""
    return any(character.isalnum() for character in text)


def check_speakable(text: str, location: str = "input") -> None:
    """ApiError 400 for an input with nothing to say: blank, or not `speakable`."""
    if not text.strip():
        raise ApiError(400, f"{location}: nothing to say", location)
    if not speakable(text):
        raise ApiError(400, f"{location}: nothing speakable (no letters or digits; only symbols, emoji, controls or "
                            "invisible characters)", location)


def parse_speech(body, limits: Limits, is_voice) -> SpeechParams:
    """Check a `/v1/audio/speech` body; `is_voice(id)` says whether a voice is registered."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = _string(body, "model")  # one model is served; SGLang-Omni's clients leave it out
    text = _string(body, "input", required=True)
    check_speakable(text)
    if len(text) > limits.max_input_chars:
        raise ApiError(413, f"input: {len(text)} characters; at most {limits.max_input_chars}", "input")
    instructions = _string(body, "instructions")
    if instructions is not None and len(instructions) > limits.max_input_chars:
        raise ApiError(413, f"instructions: {len(instructions)} characters; at most {limits.max_input_chars}", "instructions")
    speed = option_value(body, "speed")
    if speed is not None and speed != 1.0 and not can_stretch():
        raise ApiError(400, f"speed: {speed} needs PyAV on the server (the [serve] extra); only 1.0 here", "speed")
    stream_format = _string(body, "stream_format")
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format: {stream_format!r}; expected one of {list(STREAM_FORMATS)}", "stream_format")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream: expected true or false; got {stream!r}", "stream")
    if stream is False and stream_format is not None:
        raise ApiError(400, f"stream: false contradicts stream_format {stream_format!r}; leave one of them out",
                       "stream")
    response_format = option_value(body, "response_format")
    if response_format is None:  # OpenAI's mp3; SGLang-Omni's `stream: true` sends raw PCM
        default = RESPONSE_FORMAT.default
        response_format = "pcm" if stream else (default if default in supported_formats() else "wav")
    if stream is not False and stream_format is None:
        stream_format = "audio"  # OpenAI's default: the audio is sent as it is made
    if response_format not in supported_formats():
        raise ApiError(
            400, f"response_format: {response_format!r} cannot be written on this server; supported: {supported_formats()}",
            "response_format",
        )
    if stream_format and response_format not in STREAMABLE:
        raise ApiError(400, f"response_format: streaming sends {list(STREAMABLE)}; got {response_format!r}", "response_format")
    sample_rate = option_value(body, "sample_rate")
    if sample_rate is not None and response_format not in RATE_FORMATS:
        raise ApiError(400, f"sample_rate: {sample_rate} applies to {list(RATE_FORMATS)}; {response_format!r} is "
                            "coded at the model's rate", "sample_rate")
    return SpeechParams(
        model=model,
        input=text,
        voice=parse_voice(body.get("voice")),
        instructions=instructions,
        response_format=response_format,
        stream_format=stream_format,
        references=parse_references(body.get("references"), limits, is_voice),
        options=request_options(body, HTTP, limits),
        speed=OPTIONS["speed"].default if speed is None else float(speed),
        sample_rate=sample_rate,
    )


def request_options(body: dict, door: str, limits: Limits) -> dict:
    """The request options a body (or a text stream's `start` message) gives: one field per entry
    of the option schema offered at `door` (`HTTP` or `STREAM`) that the decode reads (the
    server's own, `voice` to `sample_rate`, are read by the door), each checked by the schema's one
    check (`decoding.options`), the one `generate()`, the CLI and the demo run; an ApiError (400)
    names the field. `max_new_tokens` is also held to the server's limit."""
    values = {}
    for option in options_for(door, decode=True):
        value = option_value(body, option.name)
        if value is not None:
            values[option.name] = value
    frames = values.get("max_new_tokens")
    if frames is not None and frames > limits.max_new_tokens:
        raise ApiError(400, f"max_new_tokens={frames}; this server makes at most {limits.max_new_tokens} frames a take",
                       "max_new_tokens")
    return values


# ---- the text stream (WebSocket /v1/audio/speech/stream) ----------------------------------------------

STREAM_AUDIO_FORMATS = ("pcm", "wav")
"""The formats of the schema's `response_format` a text stream sends (its default the first)."""
MIN_CHUNK_BYTES = 8
"""The smallest `chunk_bytes` a text stream may ask for (smaller chunks would cut inside words)."""


@dataclass
class TextStreamParams:
    """A checked `start` message of a text stream: the speech fields of `/v1/audio/speech` but the
    text, which arrives in `text` messages (options: the schema's entries offered to a text stream;
    `max_new_tokens` caps each chunk); chunk_bytes: the streaming chunk size (None: the published
    ~300 bytes)."""

    model: str | None
    voice: str | None
    response_format: str
    references: list = field(default_factory=list)
    options: dict = field(default_factory=dict)
    chunk_bytes: int | None = None

    @property
    def seed(self) -> int | None:
        return self.options.get("seed")


def parse_message(raw, location: str = "message") -> dict:
    """A text frame of the stream -> its JSON object with a string `type`."""
    if not isinstance(raw, str):
        raise ApiError(400, f"{location}: expected a JSON text message; got binary data", location)
    message = load_json(raw, location)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ApiError(400, f"{location}: expected an object with a \"type\" (start, text, done)", f"{location}.type")
    return message


def parse_stream_start(message: dict, limits: Limits, is_voice, max_chunk_bytes: int) -> TextStreamParams:
    """Check the `start` message: `voice`, `references`, the request options offered to a text
    stream (`request_options`; `max_new_tokens` per chunk), `response_format` ("pcm" or "wav"),
    `chunk_bytes`."""
    if message.get("type") != "start":
        raise ApiError(400, f"type: the first message must be {{\"type\": \"start\", ...}}; got {message.get('type')!r}", "type")
    if "input" in message:
        raise ApiError(400, "input: a text stream sends its text in {\"type\": \"text\"} messages", "input")
    response_format = _stream_format(message)
    return TextStreamParams(
        model=_string(message, "model"),
        voice=parse_voice(message.get("voice")),
        response_format=response_format,
        references=parse_references(message.get("references"), limits, is_voice),
        options=request_options(message, STREAM, limits),
        chunk_bytes=_number(message, "chunk_bytes", MIN_CHUNK_BYTES, max_chunk_bytes, integer=True),
    )


def _stream_format(message: dict) -> str:
    """A `start` message's `response_format`: the schema entry's, narrowed to what a text stream
    sends (`STREAM_AUDIO_FORMATS`, the first when absent, null or "")."""
    value = message.get("response_format")
    if value == "":
        return STREAM_AUDIO_FORMATS[0]
    if isinstance(value, str) and value not in STREAM_AUDIO_FORMATS:
        raise ApiError(400, f"response_format: {value!r}; a text stream sends {list(STREAM_AUDIO_FORMATS)}",
                       "response_format")
    return option_value(message, "response_format") or STREAM_AUDIO_FORMATS[0]


def parse_text_message(message: dict, received: int, limits: Limits, index: int) -> str | None:
    """A `text` message -> its text, or None for `done`. `received`: characters so far; the whole
    text is held to the input limit of `/v1/audio/speech`."""
    kind = message["type"]
    if kind == "done":
        return None
    if kind != "text":
        raise ApiError(400, f"type: expected \"text\" or \"done\"; got {kind!r}", "type")
    text = message.get("text")
    if not isinstance(text, str):
        raise ApiError(400, f"text: message {index} must carry a string; got {type(text).__name__}", "text")
    unicode_text(text, "text")
    if received + len(text) > limits.max_input_chars:
        raise ApiError(413, f"input: {received + len(text)} characters; at most {limits.max_input_chars}", "input")
    return text


def parse_voice_upload(body, limits: Limits) -> tuple[str, str, list[VoiceReference]]:
    """`POST /v1/audio/voices`: {"name", "id"?, "references": [...]} or {"name", "audio", "text"}."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    name = _string(body, "name", required=True)
    voice_id = _string(body, "id") or name
    raw = body.get("references")
    if raw is None:
        raw = [{"audio": body.get("audio"), "text": body.get("text"), "speaker": body.get("speaker")}]
    references = parse_references(raw, limits, None)
    return voice_id, name, references
