"""drama3-tiny's sizes: the published architecture (hybrid Gated DeltaNet + attention backbone
with MoE, partial codebook fusion, Codebook-MTP tower) at a size a 2-core CPU trains in hours.

`tiny_model_config(tokenizer, codec_config)` writes a `config.json` in the published layout; the
token ids come from the tokenizer (`build_tiny_tokenizer`) and the codebooks from the codec.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from transformers_drama3.configuration_drama3 import FIXED_TEXT_SETTINGS, Drama3Config
from transformers_drama3.prompting import IM_END, REFERENCE_INSTRUCTION, TEMPLATE_VERSION, TTS_INSTRUCTION, semantic_token

TINY_CORPUS_PLAN = {
    "seed": 0,
    "utterances_per_voice": 6000,
    "heldout_sentences": 40,
    "voices": ["A", "B", "D", "F"],
    "direction_rate": 0.35,
    "spanish_rate": 0.05,
    "grammar": 2,
}
"""The corpus drama3-tiny is trained on (`python -m recipes.drama3_tiny.corpus build DIR
--utterances-per-voice 6000 --voices A,B,D,F --spanish-rate 0.05 --grammar 2`); the evaluation
re-plans it to render the held-out set. (The first release was trained on grammar 1.)"""

HIDDEN_SIZE = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
TEXT_VOCABULARY = 1024
"""Byte-level BPE size before the special tokens: the corpus grammar's ~800 words mostly become
one token each, and any other text still encodes byte by byte."""
TINY_TEMPERATURE = 0.5
"""drama3-tiny's sampling temperature (its generation config; top-p stays 0.9). Measured with
the evaluation on the held-out set, it gets more outputs' words right than the published 1.0
(model_card.md)."""
TINY_REPETITION_AWARE = False
"""drama3-tiny draws its main token without repetition-aware sampling (its generation config's
`repetition_aware`). RAS redraws a main token that repeats one of the last 16 at temperature 1.0;
the phonetic codec's main token is the phoneme sounding at the frame, which repeats while the
phoneme lasts, so RAS redrew about 40 of a take's main tokens and the shipped temperature did not
apply to them. Without it the development sentences read 35.8% against 39.3% (five seeds each;
model_card.md)."""


PHONEME_LANGUAGES = {"spanish": "es", "french": "fr", "german": "de"}
"""The corpus's language tags (`corpus.LANGUAGES`) -> the espeak voice of the phonemes inside them."""
LAYOUT_TEXTS = (
    TTS_INSTRUCTION, REFERENCE_INSTRUCTION, "\n\n[Reference 1]\nText: ", "\n\n[Reference 2]\nText: ",
    "\nSpeech: ", "system\n", "user\n", "assistant\n",
)
"""The text of the layout itself: with a phoneme front end, with the tags, all that stays text."""


def text_tokenizer(texts: Iterable[str], codebook_size: int, save_directory=None):
    """The ChatML tokenizer of drama3-tiny's first release: a byte-level BPE trained on the corpus
    text plus every Drama 3 special token (see `tokenizer_build.build_drama3_tokenizer`)."""
    from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

    return build_drama3_tokenizer(
        texts=list(texts), vocab_size=TEXT_VOCABULARY, codebook_size=codebook_size, save_directory=save_directory
    )


def phoneme_tokenizer(texts: Iterable[str], codebook_size: int, save_directory=None):
    """The tokenizer of a drama3-tiny that reads phonemes: one token per espeak-ng phoneme symbol
    of the corpus (`prompting.phonemes`, en-us, the corpus's language tags in their own voice), and
    a byte-level BPE over what stays text (the layout's words, the corpus's tags and styles)."""
    from transformers_drama3.prompting.phonemes import PhonemeFrontEnd, frontend_config
    from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

    texts = list(texts)
    front_end = PhonemeFrontEnd(frontend_config("en-us", PHONEME_LANGUAGES))
    kept = [piece.content for text in texts for piece in front_end.pieces(text) if not piece.phonemes]
    return build_drama3_tokenizer(
        texts=[*LAYOUT_TEXTS, *kept], vocab_size=TEXT_VOCABULARY, codebook_size=codebook_size,
        save_directory=save_directory, phoneme_symbols=front_end.inventory(texts), text_frontend=front_end.config,
    )


TEXT_FRONTENDS = {"text": text_tokenizer, "phonemes": phoneme_tokenizer}


def build_tiny_tokenizer(texts: Iterable[str], codebook_size: int, save_directory=None, text_frontend: str = "text"):
    """drama3-tiny's tokenizer for `text_frontend` ("text": BPE over the words, the first release;
    "phonemes": phoneme tokens)."""
    if text_frontend not in TEXT_FRONTENDS:
        raise ValueError(f"text_frontend must be one of {sorted(TEXT_FRONTENDS)}; got {text_frontend!r}")
    return TEXT_FRONTENDS[text_frontend](texts, codebook_size, save_directory)


def tiny_model_config(
    tokenizer, num_codebooks: int, codebook_size: int, codebook_fusion: int = 1,
    sampling_rate: int = 22050, frame_size: int = 1024, backbone_layers: int = 4, hidden_size: int = HIDDEN_SIZE,
    tower_intermediate_size: int | None = None,
) -> Drama3Config:
    """The drama3-tiny config (published layout) for `tokenizer` and a codec with `num_codebooks`
    codebooks of `codebook_size` codes at `sampling_rate` with `frame_size` samples per frame.

    Backbone: `backbone_layers` layers (Gated DeltaNet and attention alternating, 4 by default),
    width `hidden_size` (256), MoE of 4 routed experts (2 per token) plus a gated shared expert.
    Tower: 1 shared layer and one layer per acoustic codebook, each a causal block over every row,
    as wide as the backbone (the class requires it), feed-forward `tower_intermediate_size`
    (2 x width by default), heads as the backbone's (the serving code requires it).
    """
    if backbone_layers < 2 or backbone_layers % 2:
        raise ValueError(f"backbone_layers must be even and >= 2 (DeltaNet / attention pairs); got {backbone_layers}")
    semantic_start = tokenizer.convert_tokens_to_ids(semantic_token(0))
    text_config = {
        "model_type": "fish_omni_text",
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": backbone_layers,
        "layer_types": ["linear_attention", "full_attention"] * (backbone_layers // 2),
        "mlp_layer_types": ["moe"] * backbone_layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden_size,
        "shared_expert_intermediate_size": hidden_size,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        **FIXED_TEXT_SETTINGS,
    }
    tower_config = {
        "model_type": "fish_qwen3_audio_decoder",
        "decoder_type": "codebook_mtp_shared",
        "dim": hidden_size,
        "text_dim": hidden_size,
        "n_head": HEADS,
        "n_local_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "n_layer": 1,
        "shared_enrichment_layers": 1,
        "intermediate_size": tower_intermediate_size or 2 * hidden_size,
        "norm_eps": 1e-6,
        "num_codebooks": num_codebooks,
        "vocab_size": codebook_size,
        "max_seq_len": num_codebooks + 1,
        "rope_base": 10000.0,
        "vq_backbone_codebooks": codebook_fusion,
        # the published tower's fixed settings (gates, norms, rotary layout, fusion placement)
        # are the config class's defaults
    }
    return Drama3Config(
        text_config=text_config,
        audio_decoder_config=tower_config,
        architectures=["FishOmniModel"],
        semantic_start_token_id=semantic_start,
        semantic_end_token_id=semantic_start + codebook_size - 1,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        speech_template_version=TEMPLATE_VERSION,
        tie_word_embeddings=False,
        sampling_rate=sampling_rate,
        frame_size=frame_size,
    )


def seed_phoneme_codes(model, tokenizer, phonemes, codebooks=()) -> int:
    """Start the embedding of each semantic token of a phonetic codec (`codec.phone_codec`: code
    k of codebook 0 is the phoneme `phonemes[k]`) as the embedding of that phoneme's text token(s),
    the mean over its symbols with the stress marks left out; the silence label "_" starts as the
    word boundary. The backbone then reads the phoneme being spoken and the phoneme to read as one
    vector from the first step, and has only to learn where in the text it is, not which text
    token each code denotes. Codes whose phoneme has no text token keep their random start.

    `codebooks` (the codec's other phoneme codebooks, e.g. 2-4) start the same way in the tower's
    codebook table, which is also what partial codebook fusion adds to an audio row's backbone
    input: with those codebooks fused, an audio row starts as the mean of its phonemes' text
    tokens. Returns how many semantic codes were seeded."""
    import torch

    from transformers_drama3.prompting import semantic_token

    table = model.get_input_embeddings().weight
    codebook_table = model.audio_decoder.codebook_embeddings.weight
    size = model.audio_decoder.codebook_size
    vocabulary = tokenizer.get_vocab()
    seeded = 0
    with torch.no_grad():
        for code, phoneme in enumerate(phonemes):
            ids = phoneme_text_ids(vocabulary, phoneme)
            if not ids:
                continue
            mean = table[ids].mean(dim=0)
            table[vocabulary[semantic_token(code)]] = mean
            for codebook in codebooks:
                codebook_table[codebook * size + code] = mean.to(codebook_table.dtype)
            seeded += 1
    return seeded


def phoneme_text_ids(vocabulary: dict, phoneme: str) -> list[int]:
    """The text token ids that spell a codec phoneme label (its symbols without stress marks; the
    word boundary for the silence label "_"); the symbols the tokenizer lacks are left out."""
    from transformers_drama3.prompting.phonemes import WORD_BOUNDARY, phoneme_symbols, phoneme_token

    symbols = [WORD_BOUNDARY] if phoneme == "_" else [s for s in phoneme_symbols(phoneme) if s not in STRESS_MARKS]
    return [vocabulary[phoneme_token(s)] for s in symbols if phoneme_token(s) in vocabulary]


STRESS_MARKS = ("ˈ", "ˌ")
"""espeak's primary and secondary stress: tokens of their own in the text, not phonemes."""


def speaking_rate(processor, texts: Iterable[str], seconds: Iterable[float]) -> float:
    """Text tokens a second of speech, as the processor spells the turn to speak (its
    `speak_span`): the median over (text, seconds) pairs, rounded to 0.1. This goes in the
    generation config as `text_tokens_per_second`, so frame budgets and the too-short guard expect
    as many seconds as the corpus spends on that many tokens (a phoneme front end spends ~5x the
    tokens of Qwen's tokenizer a second)."""
    from transformers_drama3.prompting import Script

    rates = []
    for text, duration in zip(texts, seconds):
        start, stop = processor.rows(Script(lines=text)).speak_span
        if duration > 0:
            rates.append((stop - start) / duration)
    if not rates:
        raise ValueError("speaking_rate: no utterance with a positive duration to measure the rate on")
    return round(statistics.median(rates), 1)


__all__ = ["TINY_CORPUS_PLAN", "seed_phoneme_codes", "speaking_rate", "build_tiny_tokenizer", "tiny_model_config", "TEXT_VOCABULARY", "HIDDEN_SIZE"]
