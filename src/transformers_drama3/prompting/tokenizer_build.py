"""A small byte-level BPE tokenizer that carries every Drama 3 special token.

The published checkpoint ships a Qwen3.5 tokenizer (`tokenizer.json` + the special tokens of the
"reference-bracket-v1" layout). Tests and tiny demo models need the same special tokens without
that multi-megabyte vocabulary: `build_drama3_tokenizer` trains a byte-level BPE on a few sentences
(any text still encodes, byte by byte if need be) and appends the special tokens in the published
order, so the semantic band `<|semantic:0|>` .. `<|semantic:{codebook_size - 1}|>` is one
contiguous id range, as in the real vocabulary.

`<|audio_separator|>` is not in any public tokenizer file we have seen; it is added here for the
layouts designed from the paper (line-by-line synthesis and infilling, see docs/prompt_layouts.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .phonemes import phoneme_token
from . import (
    AUDIO_SEPARATOR,
    CODEBOOK_SIZE,
    IM_END,
    IM_START,
    INTERLEAVE,
    NUM_SPEAKERS,
    TEXT,
    VOICE,
    semantic_token,
    speaker_token,
)

PAD = "<|endoftext|>"

# A few sentences in several scripts, so the merges are not all English; byte fallback covers the rest.
DEFAULT_TRAINING_TEXTS = (
    "convert the provided text to speech reference to the following:",
    "[Reference 1]\nText: Hello there, how are you today?\nSpeech: ",
    "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore!",
    "<whisper>Keep your voice down.</whisper> [laughs] (fast) I can't believe it; really, truly.",
    "Guten Tag, wie geht es Ihnen? Bonjour, comment allez-vous ? ¿Qué tal? Ciao, come stai?",
    "你好，今天天气很好。我们去公园散步吧！こんにちは、元気ですか。안녕하세요, 반갑습니다.",
    "user\nassistant\nsystem\n",
)

# No Jinja chat template is shipped: a template renders one string, and tokenizing the joined
# prompt changes ids at the seams and cannot write audio rows, so it could never give the published
# rows token for token. `Drama3Processor.apply_chat_template` builds them from the layout instead.


def drama3_special_tokens(codebook_size: int = CODEBOOK_SIZE) -> list[str]:
    """Every special token, in id order: ChatML, layout markers, speakers, then the semantic band."""
    return [
        PAD,
        IM_START,
        IM_END,
        VOICE,
        TEXT,
        INTERLEAVE,
        AUDIO_SEPARATOR,
        *(speaker_token(speaker) for speaker in range(NUM_SPEAKERS)),
        *(semantic_token(code) for code in range(codebook_size)),
    ]


def build_drama3_tokenizer(
    texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    codebook_size: int = CODEBOOK_SIZE,
    save_directory: str | os.PathLike | None = None,
    phoneme_symbols: Iterable[str] = (),
    text_frontend: dict | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and add the Drama 3 special tokens after its vocabulary.

    Args:
        texts: training sentences; a small multilingual default when None.
        vocab_size: size of the BPE vocabulary before the special tokens (at least 256 + 1).
        codebook_size: number of `<|semantic:N|>` tokens (the semantic codebook size, 4096 published).
        save_directory: when given, writes tokenizer.json, tokenizer_config.json and
            special_tokens_map.json there.
        phoneme_symbols, text_frontend: for a model that reads spoken text as phonemes
            (`prompting.phonemes`): one token `<|ph:s|>` per symbol, after the semantic band (the
            ids before it are those of a tokenizer without them), and the front end recorded in
            `tokenizer_config.json`. Give both or neither.

    Returns:
        A `PreTrainedTokenizerFast` whose `eos_token` is `<|im_end|>` and `pad_token` `<|endoftext|>`.
    """
    symbols = sorted(set(phoneme_symbols))
    if bool(symbols) != (text_frontend is not None):
        raise ValueError("phoneme_symbols and text_frontend go together: give both (a phoneme model) or neither")
    if any(not symbol or "|" in symbol for symbol in symbols):
        raise ValueError(f"phoneme symbols must be non-empty and hold no '|'; got {[s for s in symbols if not s or '|' in s][:5]}")
    if vocab_size <= 256:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols; got {vocab_size}")
    if codebook_size < 1:
        raise ValueError(f"codebook_size must be positive; got {codebook_size}")
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(texts) if texts is not None else DEFAULT_TRAINING_TEXTS, trainer)
    backend.add_special_tokens(drama3_special_tokens(codebook_size))
    frontend = {}
    if text_frontend is not None:
        backend.add_special_tokens([phoneme_token(symbol) for symbol in symbols])
        frontend = {"text_frontend": text_frontend}

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        model_max_length=1 << 20,
        **frontend,
    )
    if save_directory is not None:
        save_drama3_tokenizer(tokenizer, save_directory)
    return tokenizer


def save_drama3_tokenizer(tokenizer: PreTrainedTokenizerFast, save_directory: str | os.PathLike) -> None:
    """Write the published tokenizer files (transformers 5 no longer writes special_tokens_map.json)."""
    os.makedirs(save_directory, exist_ok=True)
    tokenizer.save_pretrained(save_directory)
    special_tokens_map = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    with open(os.path.join(save_directory, "special_tokens_map.json"), "w", encoding="utf-8") as handle:
        json.dump(special_tokens_map, handle, indent=2)
