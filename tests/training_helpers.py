"""A matched tiny stack for the training tests: tokenizer, codec, processor and model that agree on
codebook sizes (semantic band 64, 4 codebooks), plus synthetic "voices" and wav folders."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from codec_helpers import NUM_CODEBOOKS, RESIDUAL_CODEBOOK_SIZE, SEMANTIC_CODEBOOK_SIZE, tiny_codec
from model_helpers import tokenizer_config
from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

CODEBOOK_SIZE = SEMANTIC_CODEBOOK_SIZE  # the tiny codec's semantic codebook; residual codes < 16
RESIDUAL_SIZE = RESIDUAL_CODEBOOK_SIZE


@functools.lru_cache(maxsize=1)
def tokenizer():
    return build_drama3_tokenizer(vocab_size=300, codebook_size=CODEBOOK_SIZE)


def processor(codec=None) -> Drama3Processor:
    # references are a few frames with five words: placeholders, so no reference-length check
    return Drama3Processor(tokenizer(), codec=codec, codebook_size=CODEBOOK_SIZE, num_codebooks=NUM_CODEBOOKS,
                           min_reference_fraction=0.0)


def stack_config(hidden: int = 64, **text) -> Drama3Config:
    return tokenizer_config(
        tokenizer(), CODEBOOK_SIZE, text={"hidden_size": hidden, **text}, tower={"dim": hidden, "text_dim": hidden}
    )


def stack_model(seed: int = 0, **text) -> Drama3ForSpeechGeneration:
    torch.manual_seed(seed)
    return Drama3ForSpeechGeneration(stack_config(**text)).float()


def codec():
    return tiny_codec(0)


def voice_codes(voice: int, frames: int, seed: int) -> list[list[int]]:
    """Codes [num_codebooks][frames] of a synthetic "voice": each voice draws its codes from its own
    small set (semantic codes cycle through a voice-specific pattern; residual codes are fixed
    functions of the semantic one), so a model can learn a voice from a few examples."""
    generator = torch.Generator().manual_seed(seed)
    base = 8 * voice
    semantic = base + (torch.arange(frames) * 3 + torch.randint(0, 2, (frames,), generator=generator)) % 8
    rows = [semantic]
    for k in range(1, NUM_CODEBOOKS):
        rows.append((semantic * (k + 1) + voice) % RESIDUAL_SIZE)
    return torch.stack(rows).tolist()


WORDS = "the cat sat on a mat and then it ran far away from home to see the sea".split()


def sentence(seed: int, words: int = 5) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=words))


def voice_examples(voice: int, count: int, frames: int = 12, seed: int = 0, speaker: str | None = None) -> list[dict]:
    return [
        {
            "text": sentence(seed * 1000 + i),
            "codes": voice_codes(voice, frames, seed * 1000 + i),
            "speaker": speaker or f"voice{voice}",
            "index": i,
        }
        for i in range(count)
    ]


def tone(seconds: float, rate: int = 16000, frequency: float = 220.0, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def write_voice_folder(folder: Path, count: int = 4, rate: int = 16000) -> Path:
    """A folder of wav + txt pairs (the "my voice" layout). Clips are 15-30 ms: the tiny codec makes
    ~1400 frames per second, so this keeps rows at tens of frames."""
    import soundfile

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        soundfile.write(folder / f"clip{i}.wav", tone(0.015 + 0.005 * i, rate, 200 + 30 * i), rate)
        (folder / f"clip{i}.txt").write_text(sentence(i), encoding="utf-8")
    return folder
