"""The alignment of a phonetic codec's frames to the phoneme tokens they speak, read off the codes.

`guided_attention`'s first guide pulls the backbone's heads onto the straight diagonal (text row
n/N at frame t/T). espeak-ng's phonemes last from one spectrogram frame to many, so a head on
that line sits phonemes away from the one being spoken (recipe README, second sitting). A
phonetic codec (`codec.phone_codec`) says which phoneme every spectrogram frame speaks, so the
true alignment can be read off the target's own codes: a monotonic match of the code phonemes,
sub-frame by sub-frame, to the phoneme tokens of the text.

`align_codes_to_text` is that match: a dynamic programme over (sub-frame, text row) where a
sub-frame costs 0 on a row of its phoneme and 1 on any other (silence: 0 on a row that is not a
phoneme, a word boundary or a punctuation mark, 0.3 on a phoneme), a step forward costs each
phoneme row it skips, and staying is free. The rows are non-decreasing along the frames.

For each codec frame it gives two rows: the row of the phoneme its last spectrogram frame speaks
(`current`) and the next phoneme row of the text after it (`next`), which is what the frame after
it is likely to start with. `AlignedAttention` (in `guided_attention`) asks one head of each
attention layer to look at `current` and another at `next`.
"""

from __future__ import annotations

import numpy as np

from transformers_drama3.prompting.phonemes import phoneme_symbol, phoneme_symbols

SILENCE = "_"
SILENCE_ON_PHONEME = 0.3
STRESS_MARKS = ("ˈ", "ˌ")


def sub_frame_order(num_codebooks: int) -> list[int]:
    """The codebooks of a phonetic codec frame in spectrogram-frame order: codebook 0 is the first
    spectrogram frame's phoneme, codebook 1 the voice, codebooks 2.. the other spectrogram frames."""
    return [0, *range(2, num_codebooks)]


class PhonemeRows:
    """Which text token is which codec phoneme.

    Args:
        tokenizer: a tokenizer with phoneme tokens (`<|ph:...|>`).
        phonemes: the codec's phoneme labels (`codec.config.phonemes`, silence first).
    """

    def __init__(self, tokenizer, phonemes):
        vocabulary = tokenizer.get_vocab()
        symbol_of = {index: phoneme_symbol(token) for token, index in vocabulary.items()}
        self.symbol_of = {index: symbol for index, symbol in symbol_of.items() if symbol is not None}
        self.codes_of_symbol: dict[str, set[int]] = {}
        for code, phoneme in enumerate(phonemes):
            if phoneme == SILENCE:
                continue
            for symbol in phoneme_symbols(phoneme):
                if symbol not in STRESS_MARKS:
                    self.codes_of_symbol.setdefault(symbol, set()).add(code)
        self.silence = list(phonemes).index(SILENCE)

    def row_codes(self, token_ids) -> list[set[int] | None]:
        """Per text row: the codes that speak it, or None for a row that is not a phoneme (a word
        boundary, punctuation, a stress mark, a tag)."""
        rows = []
        for token in token_ids:
            symbol = self.symbol_of.get(int(token))
            codes = self.codes_of_symbol.get(symbol) if symbol is not None else None
            rows.append(codes or None)
        return rows


def align_codes_to_text(labels, row_codes: list[set[int] | None], silence: int = 0) -> np.ndarray:
    """The text row of every sub-frame label (`labels`: [steps] phoneme codes), monotonic.

    row_codes: per text row the codes that speak it, None for a row that is no phoneme (see
    `PhonemeRows.row_codes`). Returns [steps] row indices, non-decreasing."""
    labels = np.asarray(labels, dtype=np.int64)
    steps, rows = len(labels), len(row_codes)
    if steps == 0 or rows == 0:
        return np.zeros(steps, dtype=np.int64)
    is_phoneme = np.array([codes is not None for codes in row_codes], dtype=np.float64)
    before = np.concatenate([[0.0], np.cumsum(is_phoneme)[:-1]])  # phoneme rows before each row
    cost = np.ones((steps, rows))
    for row, codes in enumerate(row_codes):
        if codes is not None:
            cost[np.isin(labels, list(codes)), row] = 0.0
    cost[labels == silence] = np.where(is_phoneme > 0, SILENCE_ON_PHONEME, 0.0)
    index = np.arange(rows)
    back = np.zeros((steps, rows), dtype=np.int64)
    total = before + cost[0]
    for step in range(1, steps):
        jump = total - before - is_phoneme  # from row j' to a later row j costs before[j] - before[j' + 1]
        best = np.minimum.accumulate(jump)
        where = np.maximum.accumulate(np.where(jump == best, index, 0))
        best_before = np.concatenate([[np.inf], best[:-1]]) + before  # a jump from a strictly earlier row
        where_before = np.concatenate([[0], where[:-1]])
        move = best_before < total
        back[step] = np.where(move, where_before, index)
        total = np.where(move, best_before, total) + cost[step]
    after = is_phoneme.sum() - before - is_phoneme  # phoneme rows left unspoken after the last
    path = np.zeros(steps, dtype=np.int64)
    path[-1] = int(np.argmin(total + after))
    for step in range(steps - 1, 0, -1):
        path[step - 1] = back[step, path[step]]
    return path


def frame_targets(frame_codes, token_ids, phoneme_rows: PhonemeRows) -> tuple[np.ndarray, np.ndarray]:
    """(current, next) text rows, relative to `token_ids`, for each codec frame.

    frame_codes: [frames, num_codebooks] a phonetic codec's codes; token_ids: the text rows the
    frames speak. `current`: the row of the phoneme the frame's last spectrogram frame speaks;
    `next`: the first phoneme row after it (the last phoneme row when there is none)."""
    frame_codes = np.asarray(frame_codes)
    order = sub_frame_order(frame_codes.shape[1])
    labels = frame_codes[:, order].reshape(-1)
    row_codes = phoneme_rows.row_codes(token_ids)
    path = align_codes_to_text(labels, row_codes, phoneme_rows.silence)
    current = path.reshape(frame_codes.shape[0], len(order))[:, -1]
    phoneme_rows_at = [row for row, codes in enumerate(row_codes) if codes is not None]
    following = np.full(len(row_codes) + 1, phoneme_rows_at[-1] if phoneme_rows_at else 0, dtype=np.int64)
    for row in reversed(range(len(row_codes))):
        following[row] = row + 1 if row + 1 < len(row_codes) and row_codes[row + 1] is not None else following[row + 1]
    nxt = following[current]
    return current.astype(np.int64), nxt


# ---- the table of phoneme-aligned decoding ------------------------------------------------------

ALIGNMENT_SHARE = 0.05
"""A code speaks a phoneme token when at least this share of the frames aligned to the token carry it."""
ALIGNMENT_MIN_FRAMES = 100
"""Tokens with fewer aligned frames keep every code that contains their symbol (`PhonemeRows`)."""


def exact_codes(symbol: str, phonemes) -> set[int]:
    """The codec phonemes that are `symbol` itself, with or without a stress mark."""
    return {code for code, phoneme in enumerate(phonemes) if phoneme.lstrip("".join(STRESS_MARKS)) == symbol}


def learn_pronunciations(pairs, phoneme_rows: PhonemeRows, phonemes, passes: int = 2,
                         share: float = ALIGNMENT_SHARE, min_frames: int = ALIGNMENT_MIN_FRAMES) -> dict[int, set[int]]:
    """Which codes speak each phoneme token, read off aligned examples.

    pairs: (text token ids, sub-frame codes in spectrogram-frame order) per utterance, the codes as
    the language model was trained on them (the codec's own encoding of the corpus). Each pass
    aligns every utterance (`align_codes_to_text`) with the table of the pass before (the first:
    `PhonemeRows`' codes containing the symbol), then keeps for each token the codes of at least
    `share` of its frames and the codes that are its symbol exactly."""
    table: dict[int, set[int]] = {}
    counts: dict[int, dict[int, int]] = {}
    for _ in range(passes):
        counts = {}
        for token_ids, labels in pairs:
            loose = phoneme_rows.row_codes(token_ids)
            rows = [None if codes is None else (table.get(int(token)) or codes) for token, codes in zip(token_ids, loose)]
            path = align_codes_to_text(labels, rows, phoneme_rows.silence)
            for label, row in zip(labels, path):
                if label != phoneme_rows.silence and rows[row] is not None:
                    token_counts = counts.setdefault(int(token_ids[row]), {})
                    token_counts[int(label)] = token_counts.get(int(label), 0) + 1
        table = {}
        for token, token_counts in counts.items():
            symbol = phoneme_rows.symbol_of[token]
            total = sum(token_counts.values())
            kept = {code for code, n in token_counts.items() if n >= share * total} | exact_codes(symbol, phonemes)
            if total < min_frames:
                kept |= phoneme_rows.codes_of_symbol.get(symbol, set())
            table[token] = kept
    for token, symbol in phoneme_rows.symbol_of.items():  # tokens the examples never spoke
        if token not in table and phoneme_rows.codes_of_symbol.get(symbol):
            table[token] = set(phoneme_rows.codes_of_symbol[symbol])
    return table


def alignment_config(table: dict[int, set[int]], num_codebooks: int, silence: int, quiet_tokens=()) -> dict:
    """The generation config's `phoneme_alignment` entry (`transformers_drama3.phoneme_alignment`).

    quiet_tokens: the word boundary and stress-mark tokens, where the text does not pause. The
    silence caps are read off the corpus's codes (the LM's own training targets): silence runs
    inside words and at word boundaries last at most 16 sub-frames in 99% of cases (a stop's
    closure), at punctuation and tags up to 38 (`[pause]`; tags 51)."""
    return {
        "codebooks": sub_frame_order(num_codebooks), "silence": silence, "skip": 1, "end_slack": 1,
        "max_silence": 40, "short_silence": 16, "quiet_tokens": sorted(int(token) for token in quiet_tokens),
        "max_stay": 48, "release": 1.5,
        "tokens": {str(token): sorted(codes) for token, codes in sorted(table.items())},
    }


QUIET_SYMBOLS = (" ", *STRESS_MARKS)
"""Phoneme-vocabulary symbols between which a text does not pause: the word boundary and stress marks."""


def quiet_tokens(phoneme_rows: PhonemeRows) -> list[int]:
    """The tokens of `QUIET_SYMBOLS` in the tokenizer of `phoneme_rows`."""
    return sorted(token for token, symbol in phoneme_rows.symbol_of.items() if symbol in QUIET_SYMBOLS)


def corpus_pairs(corpus, processor, utterances: int, progress: bool = True) -> list[tuple[list[int], list[int]]]:
    """(turn token ids, sub-frame codes) of `utterances` train utterances spread over the corpus's
    manifest, the codes from the processor's codec (what the language model was trained on)."""
    import json
    from pathlib import Path

    import soundfile
    import torch
    from tqdm import tqdm

    records = [json.loads(line) for line in (Path(corpus) / "manifest.jsonl").read_text().splitlines() if line.strip()]
    records = [record for record in records if record["split"] == "train"]
    stride = max(1, len(records) // max(1, utterances))
    codec = processor.codec
    order = sub_frame_order(codec.config.num_codebooks)
    pairs = []
    for record in tqdm(records[::stride][:utterances], desc="encoding", disable=not progress):
        audio, rate = soundfile.read(str(Path(corpus) / record["wav"]), dtype="float32")
        with torch.no_grad():
            codes = codec.encode(torch.from_numpy(audio)[None], rate).audio_codes[0].T  # [frames, codebooks]
        inputs = processor(record["directed_text"])
        start, stop = (int(x) for x in inputs["speak_span"][0])
        pairs.append((inputs["input_ids"][0, start:stop].tolist(), codes[:, order].reshape(-1).tolist()))
    return pairs


def write_alignment(model_dir, corpus, utterances: int = 3000, progress: bool = True) -> dict:
    """Learn the alignment table of the model in `model_dir` from `corpus` and write it into the
    model's generation_config.json (atomically). Returns the entry."""
    from pathlib import Path

    from transformers import GenerationConfig

    from transformers_drama3 import Drama3Processor
    from transformers_drama3.output_files import write_text_atomic

    processor = Drama3Processor.from_pretrained(model_dir)
    phonemes = processor.codec.config.phonemes
    phoneme_rows = PhonemeRows(processor.tokenizer, phonemes)
    table = learn_pronunciations(corpus_pairs(corpus, processor, utterances, progress), phoneme_rows, phonemes)
    entry = alignment_config(table, processor.codec.config.num_codebooks, phoneme_rows.silence, quiet_tokens(phoneme_rows))
    config = GenerationConfig.from_pretrained(model_dir)
    config.phoneme_alignment = entry
    write_text_atomic(Path(model_dir) / "generation_config.json", config.to_json_string())
    return entry


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.code_alignment",
                                     description="Learn a phonetic model's phoneme-alignment table from its corpus")
    sub = parser.add_subparsers(dest="command", required=True)
    table = sub.add_parser("table", help="write generation_config.json's phoneme_alignment")
    table.add_argument("--model", required=True, help="the model folder (tokenizer, codec, generation config)")
    table.add_argument("--corpus", required=True)
    table.add_argument("--utterances", type=int, default=3000)
    args = parser.parse_args(argv)
    entry = write_alignment(args.model, args.corpus, args.utterances)
    print(f"{len(entry['tokens'])} phoneme tokens aligned; written to {args.model}/generation_config.json")


if __name__ == "__main__":
    main()
