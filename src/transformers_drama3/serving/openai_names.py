"""OpenAI's names, accepted by the server: its preset voices as aliases of served voices, its speech
model names beside the served model's own.

A client written for OpenAI (or a front end such as Open WebUI, whose default voice is `alloy`)
sends a preset voice name and a model name like `tts-1`. The server speaks them instead of failing:

- a voice a request names is, in order: a stored voice of that id; an alias the operator set
  (`drama3 serve --voice-alias alloy=NAME`); one of OpenAI's preset names, which speaks with the
  server's default voice (drama3-tiny's `A`; none for another model: the voice the prompt alone
  gives); anything else is refused 404 by name.
- `model` is not checked (one model is served); `/v1/models` and `/v1/audio/models` list the
  served model's id and the OpenAI names clients send, each saying what it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .protocol import ApiError

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
"""OpenAI's preset voices (the `voice` literal of the openai package's `audio.speech.create`)."""
OPENAI_SPEECH_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
"""OpenAI's speech model names (the openai package's `SpeechModel`)."""


def parse_voice_alias(spec: str) -> tuple[str, str]:
    """`ALIAS=VOICE` (the `--voice-alias` option) -> (alias, voice); ValueError naming the spec."""
    alias, separator, voice = spec.partition("=")
    alias, voice = alias.strip(), voice.strip()
    if not separator or not alias or not voice:
        raise ValueError(f"--voice-alias {spec!r}: expected ALIAS=VOICE, e.g. alloy=A")
    return alias, voice


@dataclass
class VoiceAliases:
    """Names a request may give for a served voice. aliases: alias -> voice id, set by the operator;
    OpenAI's preset names not among them speak with the default voice."""

    aliases: dict = field(default_factory=dict)

    @classmethod
    def from_specs(cls, specs) -> VoiceAliases:
        """From `--voice-alias ALIAS=VOICE` options; ValueError for a malformed or repeated alias."""
        aliases = {}
        for spec in specs:
            alias, voice = parse_voice_alias(spec)
            if alias in aliases:
                raise ValueError(f"--voice-alias {spec!r}: {alias!r} is aliased twice")
            aliases[alias] = voice
        return cls(aliases)

    def resolve(self, voice: str | None, is_stored, param: str = "voice") -> str | None:
        """The stored voice id a request's `voice` stands for (None: the server's default voice, which
        a preset name without an alias stands for). `is_stored(id)`: whether a voice of that id is
        stored. ApiError 404 when an operator's alias names a voice that is not stored."""
        if voice is None or is_stored(voice):
            return voice
        if voice in self.aliases:
            target = self.aliases[voice]
            if not is_stored(target):
                raise ApiError(404, f"{param}: {voice!r} is an alias of the voice {target!r}, which is not stored",
                               param, "voice_not_found")
            return target
        if voice in OPENAI_VOICES:
            return None
        return voice  # not a name this server knows: the request is refused 404 where its voice is read

    def listing(self) -> list[dict]:
        """The operator's aliases, for the voice list: {"alias", "voice"}."""
        return [{"alias": alias, "voice": voice} for alias, voice in sorted(self.aliases.items())]


def model_listing(model_name: str) -> list[dict]:
    """The model ids a request may name: the served model's, then OpenAI's (each an alias of it)."""
    served = {"id": model_name, "object": "model", "created": 0, "owned_by": "drama3"}
    aliases = [{"id": name, "object": "model", "created": 0, "owned_by": "drama3", "alias_of": model_name}
               for name in OPENAI_SPEECH_MODELS if name != model_name]
    return [served, *aliases]
