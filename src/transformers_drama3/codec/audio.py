"""Checking and shaping what callers hand the codec: waveforms in, codes in.

`encode` takes arrays and tensors already in memory (files, URLs and bytes enter through
`Drama3FeatureExtractor`); the down-mix, the resampling and the reference rule are the feature
extractor module's, so both read audio alike. Every error is a ValueError that names the input
and says what was expected, raised before any convolution runs.
"""

import numpy as np
import torch

from ..feature_extraction_drama3 import INAUDIBLE_PEAK, downmix, is_inaudible, resample

# PCM integer dtypes and the value that maps to full scale (1.0).
_PCM_FULL_SCALE = {
    torch.int8: 2.0**7,
    torch.int16: 2.0**15,
    torch.int32: 2.0**31,
}


def as_float_waveform(audio, name: str) -> torch.Tensor:
    """numpy array / torch tensor / nested list -> float32 CPU tensor, PCM integers scaled to [-1, 1].

    Raises ValueError for complex, boolean or non-PCM integer dtypes, and for non-numeric input.
    """
    if isinstance(audio, np.ndarray):
        if audio.dtype == np.uint8:
            return (torch.from_numpy(audio.astype(np.float32)) - 128.0) / 128.0
        if audio.dtype.kind not in "iuf" and audio.dtype.kind != "c" and audio.dtype.kind != "b":
            raise ValueError(f"{name} has dtype {audio.dtype}; expected a float or PCM integer array")
        if audio.dtype.kind in "iu" and audio.dtype not in (np.int8, np.int16, np.int32):
            raise ValueError(
                f"{name} has dtype {audio.dtype}; expected float audio or int8/int16/int32/uint8 PCM "
                "(other integer types have no agreed full scale)"
            )
        audio = torch.from_numpy(np.ascontiguousarray(audio))
    elif not isinstance(audio, torch.Tensor):
        try:
            audio = torch.as_tensor(np.asarray(audio, dtype=np.float32))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name} is a {type(audio).__name__} that is not numeric audio: {error}") from None
    return _tensor_to_float(audio.detach().cpu(), name)


def _tensor_to_float(audio: torch.Tensor, name: str) -> torch.Tensor:
    if audio.is_complex():
        raise ValueError(f"{name} is complex ({audio.dtype}); expected a real waveform")
    if audio.dtype == torch.bool:
        raise ValueError(f"{name} is boolean; expected a float waveform or PCM integers")
    if audio.dtype == torch.uint8:
        return (audio.float() - 128.0) / 128.0
    if audio.dtype in _PCM_FULL_SCALE:
        return audio.float() / _PCM_FULL_SCALE[audio.dtype]
    if not audio.is_floating_point():
        raise ValueError(
            f"{name} has dtype {audio.dtype}; expected float audio or int8/int16/int32/uint8 PCM "
            "(other integer types have no agreed full scale)"
        )
    return audio.float()


def check_audio(
    audio,
    name: str = "audio",
    *,
    sampling_rate: float | None = None,
    max_seconds: float | None = None,
    reject_silence: bool = False,
) -> torch.Tensor:
    """Validate one waveform and return it as a float32 tensor of the same shape.

    Checks: numeric real dtype (PCM integers are scaled), not empty, finite, at most
    `max_seconds` long (needs `sampling_rate`; the last dim is time), and, with
    `reject_silence`, audible by the reference rule (`is_inaudible`) — a reference voice that is
    all silence tells the model nothing, while silence inside generated or edited audio is fine.
    Raises ValueError naming `name`.
    """
    waveform = as_float_waveform(audio, name)
    if waveform.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(waveform.shape)}); expected at least one sample")
    if not torch.isfinite(waveform).all():
        bad = int((~torch.isfinite(waveform)).sum())
        raise ValueError(f"{name} has {bad} NaN or infinite samples; expected finite values in [-1, 1]")
    if max_seconds is not None and sampling_rate is not None:
        seconds = waveform.shape[-1] / sampling_rate
        if seconds > max_seconds:
            raise ValueError(
                f"{name} is {seconds:.1f} s long; expected at most {max_seconds:g} s "
                "(split it, or raise max_seconds)"
            )
    if reject_silence and is_inaudible(waveform):
        raise ValueError(f"{name} is silent (peak amplitude below {INAUDIBLE_PEAK:g}); expected audible audio")
    return waveform


def _check_rate(sampling_rate, name: str) -> float:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float, np.integer, np.floating)):
        raise ValueError(f"sampling_rate of {name} is {sampling_rate!r}; expected a positive number of Hz")
    if not sampling_rate > 0:
        raise ValueError(f"sampling_rate of {name} is {sampling_rate}; expected a positive number of Hz")
    return float(sampling_rate)


def _split_items(audio, lengths, name: str) -> list[tuple[str, torch.Tensor]]:
    """Any accepted layout -> list of (item name, float waveform `[channels, samples]` or `[samples]`)."""
    if isinstance(audio, (list, tuple)) and not len(audio):
        raise ValueError(f"{name} is an empty list; expected at least one waveform")
    if isinstance(audio, (list, tuple)) and len(audio) and not np.isscalar(audio[0]):
        if lengths is not None:
            raise ValueError(f"lengths was given with a list {name}; a list already carries each item's length")
        items = [(f"{name}[{i}]", as_float_waveform(item, f"{name}[{i}]")) for i, item in enumerate(audio)]
        for item_name, item in items:
            if item.dim() not in (1, 2):
                raise ValueError(
                    f"{item_name} has shape {tuple(item.shape)}; expected [samples] or [channels, samples]"
                )
        return items
    waveform = as_float_waveform(audio, name)
    if waveform.dim() == 1:
        waveform = waveform[None]
    if waveform.dim() not in (2, 3):
        raise ValueError(
            f"{name} has shape {tuple(waveform.shape)}; expected [samples], [batch, samples] "
            "or [batch, channels, samples]"
        )
    if waveform.shape[0] == 0:
        raise ValueError(f"{name} has an empty batch (shape {tuple(waveform.shape)})")
    if lengths is None:
        return [(f"{name}[{i}]", item) for i, item in enumerate(waveform)]
    lengths = _check_lengths(lengths, waveform.shape[0], waveform.shape[-1], "lengths", "samples")
    return [(f"{name}[{i}]", item[..., :length]) for i, (item, length) in enumerate(zip(waveform, lengths.tolist()))]


def _check_lengths(lengths, batch: int, longest: int, name: str, unit: str) -> torch.Tensor:
    lengths = lengths.detach().cpu() if isinstance(lengths, torch.Tensor) else torch.as_tensor(np.asarray(lengths))
    if lengths.dtype.is_floating_point or lengths.is_complex() or lengths.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {lengths.dtype}; expected integer {unit} per item")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} has shape {tuple(lengths.shape)}; expected ({batch},), one per item")
    if (lengths < 0).any() or (lengths > longest).any():
        raise ValueError(f"{name} is {lengths.tolist()}; expected 0..{longest} {unit} per item")
    return lengths.long()


def prepare_audio_batch(
    audio,
    sampling_rate,
    target_rate: float,
    *,
    lengths=None,
    max_seconds: float | None = None,
    name: str = "audio",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any accepted audio layout -> mono float32 batch `[batch, samples]` at `target_rate`,
    right-padded with zeros, and `lengths` `[batch]` (valid samples of each item).

    See `Drama3CodecModel.encode` for the accepted layouts. Each item is checked with
    `check_audio` before anything is computed.
    """
    rate = _check_rate(sampling_rate, name)
    items = []
    for item_name, item in _split_items(audio, lengths, name):
        item = downmix(check_audio(item, item_name, sampling_rate=rate, max_seconds=max_seconds), item_name)
        items.append(torch.from_numpy(resample(item.numpy(), rate, target_rate)))
    sample_lengths = torch.tensor([item.shape[-1] for item in items], dtype=torch.long)
    batch = torch.zeros(len(items), int(sample_lengths.max()))
    for row, item in enumerate(items):
        batch[row, : item.shape[-1]] = item
    return batch, sample_lengths


def check_codes(
    codes, num_codebooks: int, lengths=None, name: str = "codes", codebook_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate codes -> (long `[batch, num_codebooks, frames]` on their device, lengths `[batch]`).

    The one check of codes in this package: the codecs' `decode` and streaming decoders, and the
    processor's clips (`prompting.check_codes`, which adds the one-clip rules). Accepts
    `[num_codebooks, frames]` (one item) or `[batch, num_codebooks, frames]`, numpy or torch, any
    signed or unsigned integer dtype; floats and bools are refused. Negative codes are a
    ValueError; with `codebook_size`, so are codes at or above it (the prompt's range), without it
    codes above a codebook's size are left for the decoder to clamp.
    """
    codes = _integer_tensor(codes, num_codebooks, name)
    if codes.dim() == 2:
        codes = codes[None]
    if codes.dim() != 3 or codes.shape[1] != num_codebooks:
        raise ValueError(
            f"{name} has shape {tuple(codes.shape)}; expected [batch, {num_codebooks}, frames] "
            f"or [{num_codebooks}, frames]"
        )
    if codes.numel():
        low, high = int(codes.min()), int(codes.max())
        if codebook_size is not None and (low < 0 or high >= codebook_size):
            raise ValueError(f"{name}: codes must lie in [0, {codebook_size}); got values from {low} to {high}")
        if low < 0:
            raise ValueError(f"{name} has negative values (min {low}); expected codes >= 0")
    if lengths is None:
        lengths = torch.full((codes.shape[0],), codes.shape[-1], dtype=torch.long)
    else:
        lengths = _check_lengths(lengths, codes.shape[0], codes.shape[-1], "lengths", "frames")
    return codes.long(), lengths


def _integer_tensor(codes, num_codebooks: int, name: str) -> torch.Tensor:
    """numpy / torch integer codes -> a signed torch tensor (unsigned ones as int64)."""
    if isinstance(codes, np.ndarray):
        if codes.dtype.kind == "u":
            codes = codes.astype(np.int64)  # values past int64 wrap to negatives and are refused as such
        if codes.dtype.kind not in "ib":
            raise ValueError(
                f"{name} has dtype {codes.dtype}; expected integer codes "
                f"(codes must be an integer tensor [{num_codebooks}, frames])"
            )
        codes = torch.from_numpy(codes)
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"{name} is a {type(codes).__name__}; expected an integer tensor or array")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(
            f"{name} has dtype {codes.dtype}; expected integer codes "
            f"(codes must be an integer tensor [{num_codebooks}, frames])"
        )
    if codes.dtype in (torch.uint16, torch.uint32, torch.uint64):  # no CPU min/max kernels for these: widen
        codes = codes.to(torch.int64)
    return codes
