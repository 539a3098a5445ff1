"""The drama3-tiny codec recipe: a small config of the S2 codec class and the pieces that train it.

Training runs the codec's own modules (`Drama3CodecModel.encoder`, `.quantizer.downsample`,
`.pre_module`, the vector quantisers' projections and codebooks, `.post_module`, `.upsample`,
`.decoder`); only the quantiser step is written out here, because training needs what inference
does not: the unquantised vectors, the straight-through gradient, the codebook and commitment
losses, quantiser dropout and a bypass for warm-up. The code search is the class's own
(`VectorQuantizer.nearest_codes`: cosine, i.e. l2-normalised lookup in a low-dimensional space),
so a trained model encodes exactly as it trained.

Recipe, and why (see docs/tiny_codec.md for the measurements):
- losses and straight-through on the *unnormalised* projected vectors (normalising them inside the
  losses let the encoder output explode and the codebooks collapse, measured before);
- fan-in initialisation of every convolution (the config's `initializer_range` of 0.02 shrinks the
  signal ~5x per layer at these widths), residual branches and the output scaled by 0.1;
- warm-up that bypasses the quantiser for a share of the batch that decays to zero, then
  quantiser dropout (a random number of residual codebooks per item), so early codebooks carry the
  most and the decoder never sees only one kind of input;
- dead-code restarts from a buffer of recent encoder vectors;
- white-noise dither (-60 dBFS) on the encoder's input only: espeak writes exact digital silence,
  and on all-zero crops the codec's norms (RMSNorm eps 1e-5, ConvNeXt LayerNorm eps 1e-6) divide
  by ~sqrt(eps), which chained gave gradient norms of 1e17 at the first step (measured); the
  target stays clean, so the decoder still learns silence.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..codec import Drama3CodecConfig, Drama3CodecModel
from ..codec.modeling_codec import ResidualUnit, VectorQuantizer

TINY_SAMPLING_RATE = 22050  # espeak's own rate; 22050 / 1024 = 21.53 frames/s, the published frame rate


def tiny_codec_config(**overrides) -> Drama3CodecConfig:
    """The drama3-tiny codec: 22.05 kHz, 1024 samples per frame (21.53 frames/s), 1 semantic +
    9 residual codebooks of 256 codes (dim 8), ~1.7 kbit/s; one transformer layer in the last
    encoder block and around the quantiser."""
    sizes = dict(
        sampling_rate=TINY_SAMPLING_RATE,
        encoder_dim=8,
        encoder_rates=[2, 4, 4, 8],  # x quantizer 2 x 2 = 1024
        encoder_transformer_layers=[0, 0, 0, 1],
        encoder_transformer_window=128,
        encoder_transformer_ffn_ratio=2,
        transformer_head_dim=64,
        layer_scale_init=0.1,
        quantizer_downsample_factors=[2, 2],
        quantizer_transformer_layers=1,
        quantizer_transformer_dim=256,
        quantizer_transformer_heads=4,
        quantizer_transformer_intermediate_size=512,
        quantizer_transformer_window=64,
        convnext_layer_scale_init=0.1,
        semantic_codebook_size=256,
        num_residual_codebooks=9,
        residual_codebook_size=256,
        codebook_dim=8,
        decoder_dim=128,
        decoder_rates=[8, 4, 4, 2],
        rope_table_dtype="float32",
    )
    sizes.update(overrides)
    return Drama3CodecConfig(**sizes)


@dataclass
class RecipeConfig:
    """Loss weights and schedule of a codec training run (saved with every checkpoint)."""

    input_dither: float = 1e-3  # white noise on the encoder's input (not the target); see below
    segment_frames: int = 16  # training crops: 16 x 1024 samples = 0.74 s
    batch_size: int = 8
    learning_rate: float = 3e-4
    codebook_lr_scale: float = 10.0  # codebooks follow the moving encoder; Adam at 3e-4 moves them ~1e-4/step
    lr_warmup_steps: int = 200
    betas: tuple[float, float] = (0.8, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mel_weight: float = 15.0
    waveform_weight: float = 1.0
    codebook_weight: float = 1.0
    commitment_weight: float = 0.25
    mel_fft_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    mel_bins: tuple[int, ...] = (20, 40, 80, 128)
    bypass_steps: int = 600  # all items bypass the quantiser for this many steps...
    bypass_decay_steps: int = 1400  # ...then the share bypassing falls linearly to 0
    quantizer_dropout: float = 0.5  # share of items that keep a random number of residual codebooks
    restart_every: int = 50  # steps between dead-code restarts
    restart_usage: float = 0.02  # a code is dead below this share of its fair usage (EMA)
    usage_decay: float = 0.95  # EMA window ~20 steps (~2,500 frames): a dead code is found within ~80 steps
    recent_vectors: int = 4096  # encoder vectors kept per codebook to restart dead codes from

    def to_dict(self) -> dict:
        return asdict(self)


# ---- initialisation -----------------------------------------------------------------------------


def initialise_for_training(model: Drama3CodecModel, generator: torch.Generator, branch_scale: float = 0.1) -> None:
    """Fan-in initialisation: every (weight-normed) convolution and linear gets N(0, 1/fan_in).

    Keeps the signal's scale through the stack at small widths; weight norm's g is set to the
    direction's norm so the effective weight is the drawn one.
    """
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
                continue
            weighted = parametrize.is_parametrized(module, "weight")
            weight = module.parametrizations.weight.original1 if weighted else module.weight
            if isinstance(module, nn.ConvTranspose1d):
                fan_in = weight.shape[0] * weight.shape[2] / module.stride[0]
            else:
                fan_in = weight[0].numel()
            weight.copy_(torch.randn(weight.shape, generator=generator) / math.sqrt(fan_in))
            if weighted:
                g = module.parametrizations.weight.original0
                g.copy_(weight.flatten(1).norm(dim=1).view(g.shape))
            if module.bias is not None:
                module.bias.zero_()
        # Residual branches start near identity, and the output near silence, so the stack neither
        # grows the signal block after block nor starts with tanh saturated.
        for module in model.modules():
            if isinstance(module, ResidualUnit):
                _scale_conv(module.block[-1].conv, branch_scale)
        _scale_conv(model.decoder.model[-2].conv, branch_scale)
        for quantizer in all_vector_quantizers(model):
            quantizer.codebook.weight.copy_(torch.randn(quantizer.codebook.weight.shape, generator=generator))


def _scale_conv(conv: nn.Module, scale: float) -> None:
    if parametrize.is_parametrized(conv, "weight"):
        conv.parametrizations.weight.original0.mul_(scale)
    else:
        conv.weight.mul_(scale)


def all_vector_quantizers(model: Drama3CodecModel) -> list[VectorQuantizer]:
    """Codebook 0 (semantic) first, then the residual codebooks: index k is codebook k."""
    return [*model.quantizer.semantic_quantizer.quantizers, *model.quantizer.quantizer.quantizers]


# ---- the quantiser, as training sees it ---------------------------------------------------------


class QuantizerStep(dict):
    """What one training pass through the quantisers returns (a dict, so it can be logged):
    latent `[batch, latent_dim, frames]` for the decoder, codes `[batch, codebooks, frames]`,
    codebook_loss, commitment_loss (scalars), projected `list[[batch * frames, codebook_dim]]`
    (the unnormalised vectors each codebook was searched with, detached)."""


def quantize_for_training(
    model: Drama3CodecModel, hidden: torch.Tensor, codebooks_per_item: torch.Tensor, bypass: torch.Tensor
) -> QuantizerStep:
    """Residual quantisation of `hidden` `[batch, latent_dim, frames]` with DAC's training rules.

    codebooks_per_item `[batch]` (long, 1..num_codebooks): codebooks whose vectors item b keeps
    (quantiser dropout); every codebook is still searched and trained on every item.
    bypass `[batch]` (bool): items whose decoder input is `hidden` itself (warm-up).
    Losses are on the unnormalised projected vectors; the decoder gets the straight-through sum.
    """
    residual, quantized = hidden, torch.zeros_like(hidden)
    codes, projected, codebook_loss, commitment_loss = [], [], hidden.new_zeros(()), hidden.new_zeros(())
    for index, quantizer in enumerate(all_vector_quantizers(model)):
        encoded = quantizer.in_proj(residual)  # [batch, codebook_dim, frames], unnormalised
        with torch.no_grad():
            code = _nearest_normalised(encoded, quantizer.codebook.weight)  # [batch, frames]
        vector = quantizer.codebook(code).transpose(1, 2)  # [batch, codebook_dim, frames]
        codebook_loss = codebook_loss + F.mse_loss(vector, encoded.detach())
        commitment_loss = commitment_loss + F.mse_loss(encoded, vector.detach())
        straight_through = encoded + (vector - encoded).detach()
        decoded = quantizer.out_proj(straight_through)  # [batch, latent_dim, frames]
        keep = (index < codebooks_per_item).to(hidden.dtype)[:, None, None]
        quantized = quantized + decoded * keep
        residual = residual - decoded
        codes.append(code)
        projected.append(encoded.detach().transpose(1, 2).reshape(-1, encoded.shape[1]))
    bypassed = bypass.to(hidden.dtype)[:, None, None]
    latent = bypassed * hidden + (1 - bypassed) * quantized
    return QuantizerStep(
        latent=latent, codes=torch.stack(codes, dim=1), codebook_loss=codebook_loss,
        commitment_loss=commitment_loss, projected=projected,
    )


def _nearest_normalised(encoded: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The class's search (cosine): encoded `[batch, dim, frames]`, codebook `[size, dim]` -> `[batch, frames]`."""
    unit = F.normalize(encoded.transpose(1, 2), dim=-1)
    return (unit @ F.normalize(codebook, dim=-1).t()).argmax(dim=-1)


def reconstruct_for_training(
    model: Drama3CodecModel, audio: torch.Tensor, codebooks_per_item: torch.Tensor, bypass: torch.Tensor
) -> tuple[torch.Tensor, QuantizerStep]:
    """audio `[batch, frames * hop_length]` (the encoder's input) -> reconstruction (same shape) and the quantiser step,
    through the codec's modules in the order `encode_frames` / `decode_frames` use them."""
    stack = model.quantizer
    latent = model.encoder(audio[:, None, :])
    hidden = stack.pre_module(stack.downsample(latent))  # [batch, latent_dim, frames]
    step = quantize_for_training(model, hidden, codebooks_per_item, bypass)
    decoded = model.decoder(stack.upsample(stack.post_module(step["latent"])))
    return decoded[:, 0, :], step


# ---- schedules ----------------------------------------------------------------------------------


def bypass_share(step: int, recipe: RecipeConfig) -> float:
    """Share of items that skip the quantiser at `step`: 1 during warm-up, then linearly to 0."""
    if step < recipe.bypass_steps:
        return 1.0
    return max(0.0, 1.0 - (step - recipe.bypass_steps) / max(1, recipe.bypass_decay_steps))


def commitment_ramp(step: int, recipe: RecipeConfig) -> float:
    """Factor on the commitment loss: 0 while every item bypasses the quantiser, 1 once none does.

    While the decoder reads the encoder directly, pulling the encoder towards still-random codes
    only fights reconstruction (measured at init: its gradient on the encoder is ~1000x the mel
    loss's); the codebooks follow the encoder meanwhile (codebook loss, restarts).
    """
    return 1.0 - bypass_share(step, recipe)


def learning_rate(step: int, recipe: RecipeConfig) -> float:
    """Linear warm-up to `learning_rate`, then constant (runs are stopped by time, not a step count)."""
    return recipe.learning_rate * min(1.0, (step + 1) / max(1, recipe.lr_warmup_steps))


def draw_codebooks_per_item(batch: int, num_codebooks: int, dropout: float, generator: torch.Generator) -> torch.Tensor:
    """Quantiser dropout: `[batch]` codebooks kept, all of them for a share `1 - dropout`, else uniform 1..N."""
    random_count = torch.randint(1, num_codebooks + 1, (batch,), generator=generator)
    dropped = torch.rand(batch, generator=generator) < dropout
    return torch.where(dropped, random_count, torch.full_like(random_count, num_codebooks))


# ---- reconstruction losses ----------------------------------------------------------------------


def mel_filterbank(n_fft: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    """Triangular filters on the HTK mel scale, 0 Hz to Nyquist: `[n_mels, n_fft // 2 + 1]`."""

    def to_mel(hz):
        return 2595.0 * torch.log10(1.0 + hz / 700.0)

    edges_mel = torch.linspace(0.0, float(to_mel(torch.tensor(sampling_rate / 2))), n_mels + 2)
    edges = 700.0 * (10.0 ** (edges_mel / 2595.0) - 1.0)
    bins = torch.linspace(0.0, sampling_rate / 2, n_fft // 2 + 1)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


class MultiResolutionMelLoss(nn.Module):
    """Mean over resolutions of L1 between log10 mel spectrograms (Hann window, hop n_fft / 4)."""

    def __init__(self, sampling_rate: int, fft_sizes, mel_bins, floor: float = 1e-5):
        super().__init__()
        if len(fft_sizes) != len(mel_bins):
            raise ValueError(f"mel_fft_sizes {fft_sizes} and mel_bins {mel_bins} must have the same length")
        self.fft_sizes = list(fft_sizes)
        self.floor = floor
        for n_fft, n_mels in zip(fft_sizes, mel_bins):
            self.register_buffer(f"filters_{n_fft}", mel_filterbank(n_fft, n_mels, sampling_rate), persistent=False)
            self.register_buffer(f"window_{n_fft}", torch.hann_window(n_fft), persistent=False)

    def log_mel(self, audio: torch.Tensor, n_fft: int) -> torch.Tensor:
        """audio `[batch, time]` -> `[batch, n_mels, windows]`."""
        spectrum = torch.stft(
            audio, n_fft, hop_length=n_fft // 4, window=getattr(self, f"window_{n_fft}"), return_complex=True
        ).abs()
        return torch.log10(torch.clamp(getattr(self, f"filters_{n_fft}") @ spectrum, min=self.floor))

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses = [F.l1_loss(self.log_mel(output, n), self.log_mel(target, n)) for n in self.fft_sizes]
        return torch.stack(losses).mean()


# ---- dead-code restarts -------------------------------------------------------------------------


@dataclass
class CodebookUsage:
    """Per codebook: an EMA of code counts `[size]` and a ring of recent projected vectors `[n, dim]`."""

    counts: list[torch.Tensor]
    recent: list[torch.Tensor]
    filled: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, model: Drama3CodecModel, recent_vectors: int) -> CodebookUsage:
        quantizers = all_vector_quantizers(model)
        return cls(
            counts=[torch.full((q.codebook_size,), 1.0 / q.codebook_size) for q in quantizers],
            recent=[torch.zeros(recent_vectors, q.codebook.weight.shape[1]) for q in quantizers],
            filled=[0 for _ in quantizers],
        )

    def update(self, codes: torch.Tensor, projected: list[torch.Tensor], decay: float, generator: torch.Generator) -> None:
        """Add a step's codes `[batch, codebooks, frames]` and projected vectors (one `[n, dim]` per codebook)."""
        for index, vectors in enumerate(projected):
            size = self.counts[index].numel()
            share = torch.bincount(codes[:, index].reshape(-1), minlength=size).float() / codes[:, index].numel()
            self.counts[index].mul_(decay).add_(share, alpha=1 - decay)
            ring = self.recent[index]
            take = vectors[torch.randperm(len(vectors), generator=generator)[: len(ring) // 8]]
            start = self.filled[index] % len(ring)
            positions = (start + torch.arange(len(take))) % len(ring)
            ring[positions] = take
            self.filled[index] += len(take)

    def perplexities(self) -> list[float]:
        """exp(entropy) of each codebook's EMA usage: the number of codes in effective use."""
        out = []
        for counts in self.counts:
            p = counts / counts.sum()
            out.append(float(torch.exp(-(p * torch.log(p.clamp_min(1e-12))).sum())))
        return out

    def state_dict(self) -> dict:
        return {"counts": self.counts, "recent": self.recent, "filled": self.filled}

    def load_state_dict(self, state: dict) -> None:
        self.counts = [t.clone() for t in state["counts"]]
        self.recent = [t.clone() for t in state["recent"]]
        self.filled = list(state["filled"])


def restart_dead_codes(
    model: Drama3CodecModel,
    usage: CodebookUsage,
    threshold: float,
    generator: torch.Generator,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[int]:
    """Replace codes whose EMA usage is below `threshold / size` by recent encoder vectors.

    The replaced rows' Adam moments are zeroed so they start fresh. Returns the number restarted
    per codebook.
    """
    restarted = []
    with torch.no_grad():
        for index, quantizer in enumerate(all_vector_quantizers(model)):
            counts, available = usage.counts[index], min(usage.filled[index], len(usage.recent[index]))
            dead = torch.nonzero(counts < threshold / counts.numel()).flatten()
            if len(dead) == 0 or available == 0:
                restarted.append(0)
                continue
            pool = usage.recent[index][:available]
            picks = torch.randint(0, available, (len(dead),), generator=generator)
            weight = quantizer.codebook.weight
            weight[dead] = pool[picks] + 1e-3 * torch.randn(len(dead), weight.shape[1], generator=generator)
            counts[dead] = 1.0 / counts.numel()
            if optimizer is not None:
                for key, moment in optimizer.state.get(weight, {}).items():
                    if key != "step" and moment.shape == weight.shape:
                        moment[dead] = 0.0
            restarted.append(len(dead))
    return restarted


def codebook_perplexity(codes: torch.Tensor, sizes: list[int]) -> list[float]:
    """Per codebook, exp(entropy) of the code histogram of `codes` `[batch, codebooks, frames]`."""
    out = []
    for index, size in enumerate(sizes):
        p = torch.bincount(codes[:, index].reshape(-1), minlength=size).float()
        p = p / p.sum()
        out.append(float(torch.exp(-(p * torch.log(p.clamp_min(1e-12))).sum())))
    return out
