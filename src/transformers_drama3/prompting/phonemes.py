"""The phoneme text front end: spoken text -> espeak-ng's IPA phonemes, tags kept as written.

A model whose tokenizer records a `text_frontend` reads the *spoken* text of every turn and
reference as phonemes, one token per phoneme (`phoneme_symbols`), stress mark, punctuation mark
and word boundary; everything else (the system prompt, speaker tokens, point tags `[pause]`, scoped tags
`<whisper>`, style prefixes `(fast)`, a director's note `[...]`) stays text. The note stays text
because it says how to speak, not what to say. A model without the entry reads text as today.

The config, saved in `tokenizer_config.json` and `processor_config.json`:

    {"type": "phonemes", "backend": "espeak-ng", "language": "en-us",
     "languages": {"spanish": "es"}, "version": "1.52.0"}

`language` is the espeak voice for all spoken text; `languages` maps a scoped language tag to the
voice of the text inside it. The backend is libespeak-ng from the `espeakng-loader` wheel (it
ships the library and its data, so `pip install` is enough), called through ctypes: 0.2 ms a
sentence, deterministic. `version` is the library's; another version may spell a few words
differently, which `PhonemeFrontEnd` warns about.

Phonemes can be written by hand in braces, "Say {təmˈɑːtoʊ}.", and are then read as written
(pronunciation control). `Drama3Processor.parse` spells phoneme rows back the same way, so a
parsed request writes the same rows again (the original words cannot be recovered from phonemes).
"""

from __future__ import annotations

import ctypes
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

FRONTEND_TYPE = "phonemes"
BACKEND = "espeak-ng"
WORD_BOUNDARY = " "
PUNCTUATION = ".,;:!?¡¿…"
INSTALL_HINT = "pip install espeakng-loader (the phonemiser of models with a phoneme text front end)"

# Phonemes written by hand, read as written: "{həlˈoʊ}" (how `parse` spells phoneme rows back).
_LITERAL = re.compile(r"\{([^{}]*)\}")
# Kept as written: scoped tags <whisper>, </whisper>; point tags [pause]; style prefixes (fast).
_KEPT = re.compile(r"(</?[A-Za-z][A-Za-z0-9_-]*>|\[[^\[\]]*\]|\([^()]*\))")
_SCOPED = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9_-]*)>")
# A punctuation run ends a clause, except "." or "," between digits ("3,000", "2.5").
_CLAUSE_SPLIT = re.compile(r"((?:(?<!\d)[.,]|[.,](?!\d)|[;:!?…¡¿])+)")
_BOUNDARY_RUN = re.compile(" {2,}")
# espeak marks words it reads in another language: "(en)hˈɛloʊ(es)".
_LANGUAGE_SWITCH = re.compile(r"\([a-z]{2,3}(?:-[a-z0-9-]+)?\)")


# Phonemes espeak writes with more than one character, each one token: affricates, diphthongs,
# long vowels (a stress mark stays a token of its own).
MULTI_CHARACTER_PHONEMES = (
    "aɪə", "aʊə", "tʃ", "dʒ", "eɪ", "aɪ", "ɔɪ", "aʊ", "oʊ", "əʊ", "iː", "uː", "ɑː", "ɔː", "ɜː", "ɪə", "eə", "ʊə",
)
_SYMBOL = re.compile("|".join(sorted(MULTI_CHARACTER_PHONEMES, key=len, reverse=True)) + "|.", re.S)


def phoneme_symbols(phonemes: str) -> list[str]:
    """A phoneme string as its symbols: the longest `MULTI_CHARACTER_PHONEMES` match, else one character."""
    return _SYMBOL.findall(phonemes)


def phoneme_token(symbol: str) -> str:
    """The vocabulary entry of one phoneme symbol (a word boundary is the symbol " ")."""
    return f"<|ph:{symbol}|>"


_PHONEME_TOKEN = re.compile(r"<\|ph:(.+?)\|>", re.S)


def phoneme_symbol(token: str) -> str | None:
    """The symbol of a phoneme token, None for any other token."""
    match = _PHONEME_TOKEN.fullmatch(token)
    return None if match is None else match.group(1)


def phoneme_literal(phonemes: str) -> str:
    """Phonemes as text the front end reads back unchanged: "{həlˈoʊ}", word boundaries at the
    ends written outside the braces (" həlˈoʊ " -> " {həlˈoʊ} "; a lone boundary stays " ")."""
    core = phonemes.strip(WORD_BOUNDARY)
    if not core:
        return phonemes
    start = phonemes.index(core)
    return f"{phonemes[:start]}{{{core}}}{phonemes[start + len(core):]}"


@dataclass(frozen=True)
class Piece:
    """A run of a phonemised text: phoneme symbols (`phonemes`) or text kept as written."""

    content: str
    phonemes: bool


# ---- the backend ------------------------------------------------------------------------------------


class _Espeak:
    """libespeak-ng through ctypes; one instance per process (the library keeps global state)."""

    _AUDIO_OUTPUT_SYNCHRONOUS = 2
    _INITIALIZE_DONT_EXIT = 0x8000
    _INITIALIZE_PHONEME_EVENTS = 0x0001  # speech reports each phoneme and where it starts...
    _INITIALIZE_PHONEME_IPA = 0x0002  # ... named in IPA (what `phonemes` returns is unchanged)
    _CHARS_UTF8 = 1
    _SSML = 0x10
    _END_PAUSE = 0x1000  # the pause the espeak-ng program adds at the end
    _PHONEMES_IPA = 0x02
    _EVENT_LIST_TERMINATED, _EVENT_PHONEME = 0, 7
    _RATE, _PITCH = 1, 3

    def __init__(self):
        try:
            import espeakng_loader
        except ImportError as error:
            raise ImportError(f"the phoneme text front end needs libespeak-ng: {INSTALL_HINT}") from error
        library = ctypes.cdll.LoadLibrary(espeakng_loader.get_library_path())
        library.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        library.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        library.espeak_TextToPhonemes.restype = ctypes.c_char_p
        library.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        library.espeak_Info.restype = ctypes.c_char_p
        library.espeak_Info.argtypes = [ctypes.c_void_p]
        library.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        library.espeak_GetParameter.argtypes = [ctypes.c_int, ctypes.c_int]
        library.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        library.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                         ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        data = espeakng_loader.get_data_path().encode()
        options = self._INITIALIZE_DONT_EXIT | self._INITIALIZE_PHONEME_EVENTS | self._INITIALIZE_PHONEME_IPA
        if library.espeak_Initialize(self._AUDIO_OUTPUT_SYNCHRONOUS, 0, data, options) <= 0:
            raise RuntimeError(f"libespeak-ng failed to initialise with its data at {data.decode()}")
        self.library = library
        self.version = library.espeak_Info(None).decode()
        self.voice: str | None = None
        self.lock = threading.Lock()

    def phonemes(self, text: str, voice: str) -> str:
        """IPA of `text` (no punctuation: espeak drops it), words separated by single spaces."""
        with self.lock:
            if voice != self.voice:
                if self.library.espeak_SetVoiceByName(voice.encode()) != 0:
                    raise ValueError(f"espeak-ng has no voice {voice!r} for the phoneme text front end")
                self.voice = voice
            buffer = ctypes.create_string_buffer(text.encode())
            pointer = ctypes.c_void_p(ctypes.addressof(buffer))
            clauses = []
            while pointer.value:
                clauses.append(self.library.espeak_TextToPhonemes(ctypes.byref(pointer), self._CHARS_UTF8, self._PHONEMES_IPA).decode())
        return " ".join(" ".join(_LANGUAGE_SWITCH.sub("", clause).split()) for clause in clauses).strip()

    def speak(self, ssml: str, voice: str, pitch: int, speed: int) -> tuple[np.ndarray, list[tuple[str, int]]]:
        """`ssml` (`<speak>...</speak>` or plain text) spoken in `voice` at `pitch` (0-99) and
        `speed` (words a minute): int16 samples [time] at the library's rate, and each phoneme
        (IPA with its stress mark, the front end's symbols) with the sample it starts at.

        Only the first speech of a process is repeatable: the library carries state from one
        utterance into the next (`speak_in_fresh_process` speaks each in a forked child)."""
        chunks, phonemes = [], []

        @_SYNTH_CALLBACK
        def collect(samples, count, events):
            if count > 0:
                chunks.append(np.ctypeslib.as_array(samples, shape=(count,)).copy())
            index = 0
            while events[index].type != self._EVENT_LIST_TERMINATED:
                event = events[index]
                if event.type == self._EVENT_PHONEME and event.id.string:
                    phonemes.append((event.id.string.decode("utf-8", "replace"), int(event.sample)))
                index += 1
            return 0

        encoded = ssml.encode()
        with self.lock:
            # SSML can leave another voice selected (<voice xml:lang="es">, <speak xml:lang>): the
            # next `phonemes` selects its voice again rather than trust the last one set.
            self.voice = None
            if self.library.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ValueError(f"espeak-ng has no voice {voice!r}")
            before = {name: self.library.espeak_GetParameter(name, 1) for name in (self._PITCH, self._RATE)}
            self.library.espeak_SetParameter(self._PITCH, int(pitch), 0)
            self.library.espeak_SetParameter(self._RATE, int(speed), 0)
            self.library.espeak_SetSynthCallback(collect)
            try:
                flags = self._CHARS_UTF8 | self._SSML | self._END_PAUSE
                status = self.library.espeak_Synth(encoded, len(encoded) + 1, 0, 1, 0, flags, None, None)
            finally:  # the phoneme front end finds the library as it was
                self.library.espeak_SetSynthCallback(_NO_CALLBACK)
                for name, value in before.items():
                    self.library.espeak_SetParameter(name, value, 0)
        if status != 0:
            raise RuntimeError(f"libespeak-ng could not speak {ssml[:60]!r} (status {status})")
        return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)), phonemes


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    """libespeak-ng's espeak_EVENT."""

    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EventId)]


_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))
_NO_CALLBACK = ctypes.cast(None, _SYNTH_CALLBACK)


def _speak_fresh(call: tuple[str, str, int, int]):
    return espeak().speak(*call)


def speak_in_fresh_process(ssml: str, voice: str, pitch: int, speed: int) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """`_Espeak.speak` in a child forked for this one utterance: the same samples every call (the
    library's first speech in a process), where speaking in this process depends on what it spoke
    before. POSIX only (fork). The parent must not have spoken itself (`_Espeak.speak`): a child
    starts from the library's state at the fork."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_speak_fresh, ((ssml, voice, pitch, speed),))


_ESPEAK: list[_Espeak] = []
_ESPEAK_CREATION = threading.Lock()


def espeak() -> _Espeak:
    """The process's one `_Espeak` (created once even when threads ask at the same time: two would
    initialise the library twice and call it under two different locks)."""
    with _ESPEAK_CREATION:
        if not _ESPEAK:
            _ESPEAK.append(_Espeak())
        return _ESPEAK[0]


def espeak_version() -> str:
    """The version of the installed libespeak-ng (ImportError with the install hint without it)."""
    return espeak().version


# ---- the front end ------------------------------------------------------------------------------


def frontend_config(language: str = "en-us", languages: dict[str, str] | None = None) -> dict[str, Any]:
    """The `text_frontend` entry of a model reading espeak-ng phonemes in `language`."""
    return {
        "type": FRONTEND_TYPE,
        "backend": BACKEND,
        "language": language,
        "languages": dict(sorted((languages or {}).items())),
        "version": espeak_version(),
    }


def check_frontend_config(config: Any, location: str = "text_frontend") -> dict[str, Any]:
    """The config, or a ValueError naming what is wrong in it."""
    if not isinstance(config, dict):
        raise ValueError(f"{location}: expected a dict like {{'type': 'phonemes', ...}}; got {config!r}")
    if config.get("type") != FRONTEND_TYPE or config.get("backend") != BACKEND:
        raise ValueError(
            f"{location}: unknown front end {config.get('type')!r} / backend {config.get('backend')!r}; "
            f"this version knows type {FRONTEND_TYPE!r} with backend {BACKEND!r}"
        )
    if not isinstance(config.get("language"), str) or not config["language"]:
        raise ValueError(f"{location}: 'language' must name an espeak-ng voice such as 'en-us'; got {config.get('language')!r}")
    languages = config.get("languages", {})
    if not isinstance(languages, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in languages.items()):
        raise ValueError(f"{location}: 'languages' must map tag names to espeak-ng voices; got {languages!r}")
    return config


class PhonemeFrontEnd:
    """Spoken text -> `Piece`s: phonemes where words are spoken, tags as written.

    Args:
        config: a `text_frontend` entry (`frontend_config`); checked here, and the phonemiser
            loaded here, so a missing `espeakng-loader` fails when the processor is made.
    """

    def __init__(self, config: dict[str, Any]):
        self.config = check_frontend_config(config)
        self.language = config["language"]
        self.languages = dict(config.get("languages", {}))
        try:
            backend = espeak()
        except ImportError as error:
            raise ImportError(f"this model's tokenizer reads phonemes (text_frontend={config}); {INSTALL_HINT}") from error
        if config.get("version") not in (None, backend.version):
            warnings.warn(
                f"the model's phonemes were made with espeak-ng {config['version']}; the installed one is "
                f"{backend.version}, which may spell some words differently",
                stacklevel=2,
            )
        self.backend = backend

    def pieces(self, text: str) -> list[Piece]:
        """`text` as runs of phonemes and kept tags; white space between runs is a word boundary.

        "(fast) Hello, world [pause] <whisper>bye</whisper>" ->
        "(fast)" | " həlˈoʊ, wˈɜːld " | "[pause]" | " " | "<whisper>" | "bˈaɪ" | "</whisper>".

        Phonemes in braces are taken as written, not phonemised: "Say {təmˈɑːtoʊ}." says the
        word as spelled there (the notation `phoneme_literal` writes and `Drama3Processor.parse`
        gives back for phoneme rows)."""
        pieces: list[Piece] = []
        open_tags: list[str] = []
        for number, outer in enumerate(_LITERAL.split(text)):
            if number % 2:
                if outer:
                    pieces.append(Piece(outer, phonemes=True))
                continue
            for index, chunk in enumerate(_KEPT.split(outer)):
                if index % 2:
                    scoped = _SCOPED.fullmatch(chunk)
                    if scoped is not None:
                        if scoped.group(1):
                            if open_tags and open_tags[-1] == scoped.group(2):
                                open_tags.pop()
                        else:
                            open_tags.append(scoped.group(2))
                    pieces.append(Piece(chunk, phonemes=False))
                    continue
                symbols = self.phonemize_chunk(chunk, self.voice_for(open_tags))
                if symbols:
                    pieces.append(Piece(symbols, phonemes=True))
        return _merged(pieces)

    def voice_for(self, open_tags: list[str]) -> str:
        return next((self.languages[tag] for tag in reversed(open_tags) if tag in self.languages), self.language)

    def phonemize_chunk(self, chunk: str, voice: str) -> str:
        """Words and punctuation without tags -> phoneme symbols, punctuation kept; each run of
        white space (at the ends too) becomes one word boundary."""
        out = ""
        for index, part in enumerate(_CLAUSE_SPLIT.split(chunk)):
            if index % 2:
                out += part
                continue
            words = part.split()
            if part[:1].isspace():
                out += WORD_BOUNDARY
            if words:
                out += self.backend.phonemes(" ".join(words), voice)
                if part[-1:].isspace():
                    out += WORD_BOUNDARY
        return _BOUNDARY_RUN.sub(WORD_BOUNDARY, out)

    def phonemes(self, text: str) -> str:
        """The phonemes of `text` alone, tags left out (what the tokenizer spells of it)."""
        return "".join(piece.content for piece in self.pieces(text) if piece.phonemes)

    def inventory(self, texts) -> set[str]:
        """The phoneme symbols of `texts`, every punctuation mark and the word boundary: the
        phoneme tokens a tokenizer for this front end needs."""
        symbols = {WORD_BOUNDARY, *PUNCTUATION}
        for text in texts:
            symbols.update(phoneme_symbols(self.phonemes(text)))
        return symbols


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent phoneme runs joined, one boundary kept where two meet."""
    merged: list[Piece] = []
    for piece in pieces:
        if merged and merged[-1].phonemes and piece.phonemes:
            left, right = merged[-1].content, piece.content
            if left.endswith(WORD_BOUNDARY) and right.startswith(WORD_BOUNDARY):
                right = right[1:]
            merged[-1] = Piece(left + right, phonemes=True)
        else:
            merged.append(piece)
    return merged


def text_frontend(config: dict[str, Any] | None) -> PhonemeFrontEnd | None:
    """The front end a `text_frontend` entry asks for; None (text read as text) without one."""
    return None if config is None else PhonemeFrontEnd(config)
