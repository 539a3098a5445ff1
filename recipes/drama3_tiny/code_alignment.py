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
