"""Train drama3-tiny's phonetic codec (`Drama3PhoneCodecModel`) on phoneme-labelled espeak speech.

    python -m recipes.drama3_tiny.phone_codec_fit label --corpus CORPUS --out LABELS --utterances 7000 --jobs 2
    python -m recipes.drama3_tiny.phone_codec_fit train --labels LABELS --out RUN --part decoder --max-steps 3000
    python -m recipes.drama3_tiny.phone_codec_fit train --labels LABELS --out RUN --part recogniser --max-steps 1500
    python -m recipes.drama3_tiny.phone_codec_fit export --labels LABELS --out RUN          # RUN/codec
    python -m recipes.drama3_tiny.phone_codec_fit label --sentences FILE --utterances 600 --voices A,B --out EXTRA
    python -m recipes.drama3_tiny.phone_codec_fit finetune --codec RUN/codec --labels LABELS --extra-labels EXTRA \
        --extra-repeat 3 --voices A,B --out TUNED                                             # TUNED/codec
    python -m recipes.drama3_tiny.phone_codec_fit evaluate --codec RUN/codec --json codec.json  # Whisper WER

`label` speaks the corpus's train texts again with libespeak-ng (`corpus.aligned_synthesize`: the
same voices, each phoneme with the sample it starts at) and keeps, per utterance, the phoneme of
every spectrogram frame (`frame_labels`), its voice label (`voice_label`) and its log-mel. `train`
trains one half of the codec on them: the decoder (labels -> log-mel, L1) or the recogniser
(log-mel -> labels, cross entropy); the two halves are independent, so they train side by side on
two cores. Training is step-based (cosine rate over `--max-steps`, each step's batch a function
of seed and step), time-boxed by `--minutes` and resumable (`--resume`, checkpoints every
`--save-minutes`). `export` puts both halves into one codec folder. `label --sentences` labels a
file of sentences in the given voices; `finetune` trains a saved codec's decoder further (by
default on the codes its recogniser writes for the speech, the codes it decodes) and saves the
codec with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HOP = 256  # spectrogram hop of the codec (samples)
SILENT_MEAN_ABS = 4.0  # int16: a spectrogram hop quieter than this on average is silence
PARTS = {
    "decoder": ("phoneme_embedding", "voice_embedding", "decoder", "decoder_norm", "decoder_output"),
    "recogniser": ("input_mean", "input_scale", "recogniser_input", "recogniser", "recogniser_norm",
                   "phoneme_head", "voice_head"),
}


# ---- labels -------------------------------------------------------------------------------------

def frame_labels(samples: np.ndarray, phonemes: list[tuple[str, int]], frames: int, silence: str = "_") -> list[str]:
    """The phoneme sounding in each of `frames` spectrogram frames: the one started last before the
    centre of the frame's window (frame j covers samples [256 j - 768, 256 j + 256): centre 256 j -
    256), or `silence` before the first phoneme or where the hop around the centre is silent."""
    starts = np.array([start for _, start in phonemes] + [np.iinfo(np.int64).max])
    names = [name for name, _ in phonemes]
    centres = np.arange(frames) * HOP - HOP
    which = np.searchsorted(starts, centres, side="right") - 1
    loudness = np.abs(np.concatenate([np.zeros(2 * HOP), samples.astype(np.float32), np.zeros(2 * HOP)]))
    labels = []
    for frame, centre in enumerate(centres):
        around = loudness[centre + 2 * HOP - HOP // 2 : centre + 2 * HOP + HOP // 2]
        quiet = around.size == 0 or around.mean() < SILENT_MEAN_ABS
        labels.append(silence if which[frame] < 0 or quiet else names[which[frame]])
    return labels


def voice_label(directed_text: str, voice) -> str:
    """What the codec's voice code names: the espeak variant, the pitch after the styles, and
    whether any of it is whispered, e.g. "m1 p75" or "f2 p65 whisper"."""
    from .corpus import STYLES, parse_directed

    directed = parse_directed(directed_text)
    pitch = voice.pitch + sum(STYLES[style][1] for style in directed.styles)
    whisper = any(segment.whisper for segment in directed.segments)
    return f"{voice.variant} p{min(99, max(0, pitch))}" + (" whisper" if whisper else "")


def aligned_segments_synthesize(directed_text: str, voice) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """`corpus.aligned_synthesize`, with a silence label where each segment starts and after the
    last (a segment's leading and trailing audio is not its neighbour's last phoneme)."""
    from transformers_drama3.prompting.phonemes import speak_in_fresh_process

    from .corpus import espeak_calls

    parts, phonemes, offset = [], [], 0
    for call in espeak_calls(directed_text, voice):
        samples, starts = (np.zeros(call, dtype=np.int16), []) if isinstance(call, int) else speak_in_fresh_process(*call)
        phonemes.append(("_", offset))
        phonemes += [(symbol, offset + start) for symbol, start in starts]
        parts.append(samples)
        offset += len(samples)
    phonemes.append(("_", offset))
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)), phonemes


def label_utterance(codec, uid: str, directed_text: str, voice) -> dict:
    """One labelled utterance: id, text, voice label, frame labels, log-mel float16 [n_mels, frames + 4]
    (the 4 frames after the end see the audio's tail, then silence)."""
    samples, phonemes = aligned_segments_synthesize(directed_text, voice)
    frames = -(-len(samples) // codec.hop_length) * codec.config.mel_frames_per_frame
    audio = torch.zeros(1, (frames + 4) * HOP)
    audio[0, : len(samples)] = torch.from_numpy(samples.astype(np.float32) / 32768.0)
    with torch.no_grad():
        log_mel = codec.log_mel(audio)[0].to(torch.float16)
    return {"id": uid, "text": directed_text, "voice": voice_label(directed_text, voice),
            "labels": frame_labels(samples, phonemes, frames), "log_mel": log_mel}


def heldout_items(voices: str = "A,B,D,F") -> list[tuple[str, str, str]]:
    """(id, text, voice name) of `drama3 eval`'s held-out sentences in each voice."""
    from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES

    return [(f"heldout-{v}-{i:02d}", s, v) for v in voices.split(",") for i, s in enumerate(HELDOUT_SENTENCES)]


def spread(records: list, count: int) -> list:
    """`count` records evenly spaced over `records` (a corpus manifest lists its voices one after
    another: the first `count` would leave voices out)."""
    if count >= len(records):
        return list(records)
    return [records[i * len(records) // count] for i in range(count)]


def sentence_items(sentences: str | Path, count: int, voices: list[str]) -> list[tuple[str, str, str]]:
    """(id, text, voice name) of the first `count` sentences of the file `sentences` (a line each;
    blank lines and lines starting with # skipped) in each of `voices`: ids VOICE-everyday-NNNNN,
    so `corpus_voice` reads their voice. Sentence after sentence, each in every voice."""
    from .corpus import VOICES_BY_NAME

    unknown = [name for name in voices if name not in VOICES_BY_NAME]
    if unknown:
        raise ValueError(f"voices {unknown}: unknown; expected names from {sorted(VOICES_BY_NAME)}")
    lines = [line.strip() for line in Path(sentences).read_text(encoding="utf-8").splitlines()]
    texts = [line for line in lines if line and not line.startswith("#")][:count]
    if not texts:
        raise ValueError(f"{sentences}: no sentences")
    return [(f"{name}-everyday-{index:05d}", text, name) for index, text in enumerate(texts) for name in voices]


def label_shard(corpus: Path | None, out: Path, utterances: int, shard: int, shards: int,
                voices: list[str] | None = None, tag: str | None = None, sentences: str | Path | None = None) -> Path:
    from transformers_drama3.codec import Drama3MelCodecModel, Drama3MelCodecConfig
    from tqdm import tqdm

    from .corpus import VOICES_BY_NAME

    path = out / f"labels-{tag + '-' if tag else ''}{shard:02d}-of-{shards:02d}.pt"
    if path.exists():
        return path
    torch.set_num_threads(1)
    analysis = Drama3MelCodecModel(Drama3MelCodecConfig()).eval()  # its log-mel is the phone codec's
    if sentences is not None:
        items = sentence_items(sentences, utterances, voices)[shard::shards]
    else:
        items = [(r.id, r.directed_text, r.voice) for r in chosen_records(corpus, out, utterances, voices, tag)][shard::shards]
    rows = [label_utterance(analysis, uid, text, VOICES_BY_NAME[name])
            for uid, text, name in tqdm(items, desc=f"labelling {shard + 1}/{shards}", mininterval=30)]
    temporary = path.with_suffix(".tmp")
    torch.save(rows, temporary)
    os.replace(temporary, path)
    return path


def chosen_records(corpus: Path, out: Path, utterances: int, voices: list[str] | None = None,
                   tag: str | None = None) -> list:
    """The train records a `label` run labels: `utterances` of them evenly spread over the corpus's
    train records (of `voices` only, when given). A tagged run adds to a folder: it leaves out the
    utterances that the folder's untagged shards already hold."""
    from .corpus import read_manifest

    train = [r for r in read_manifest(corpus / "manifest.jsonl")
             if r.split == "train" and (voices is None or r.voice in voices)]
    if tag:
        done = {row["id"] for path in out.glob("labels-[0-9]*.pt") for row in torch.load(path, weights_only=False)}
        train = [r for r in train if r.id not in done]
    return spread(train, utterances)


def label(corpus: str | Path | None, out: str | Path, utterances: int, jobs: int = 1, voices: list[str] | None = None,
          tag: str | None = None, sentences: str | Path | None = None) -> list[Path]:
    """Label `utterances` train utterances of `corpus` (of `voices` only, when given), evenly
    spread, into `out` (one shard per job, each written whole once done: a killed run redoes only
    the shards it had not finished). With `tag` the shards are `labels-TAG-*.pt` beside the
    folder's first ones, and hold other utterances than those (more data for some voices).

    With `sentences` (a file of sentences, one a line) and no corpus: the file's first
    `utterances` sentences, each spoken in every one of `voices` (`sentence_items`)."""
    if (corpus is None) == (sentences is None):
        raise ValueError("label either a corpus or a sentences file")
    if sentences is not None:
        if not voices:
            raise ValueError("labelling a sentences file needs the voices to speak it in")
        sentence_items(sentences, utterances, voices)  # a bad file or voice fails here, before any worker
    corpus, out = (None if corpus is None else Path(corpus)), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tag is not None and not tag.isalpha():
        raise ValueError(f"tag {tag!r}: letters only (it names the shard files)")
    if jobs == 1:
        return [label_shard(corpus, out, utterances, 0, 1, voices, tag, sentences)]
    command = [sys.executable, "-m", "recipes.drama3_tiny.phone_codec_fit", "label", "--out", str(out),
               "--utterances", str(utterances), "--jobs", str(jobs)]
    command += ["--corpus", str(corpus)] if corpus is not None else ["--sentences", str(sentences)]
    command += ["--voices", ",".join(voices)] if voices else []
    command += ["--tag", tag] if tag else []
    workers = [subprocess.Popen([*command, "--shard", str(i)]) for i in range(jobs)]
    failed = [i for i, worker in enumerate(workers) if worker.wait() != 0]
    if failed:
        raise RuntimeError(f"labelling shards {failed} failed")
    return sorted(out.glob(f"labels-{tag + '-' if tag else ''}[0-9]*-of-{jobs:02d}.pt"))


def read_labels(folder: str | Path) -> list[dict]:
    paths = sorted(Path(folder).glob("labels-*.pt"))
    if not paths:
        raise FileNotFoundError(f"{folder}: no labels-*.pt shards; run the label step first")
    return [row for path in paths for row in torch.load(path, weights_only=False)]


# ---- the codec ----------------------------------------------------------------------------------

def corpus_voice(uid: str) -> str:
    """The corpus voice of a labelled utterance, from its corpus id ("A-train-00012" -> "A")."""
    return uid.split("-", 1)[0]


def codec_config(rows: list[dict], **sizes):
    """The codec config for the phoneme and voice labels of `rows` (silence first, then sorted)."""
    from transformers_drama3.codec import Drama3PhoneCodecConfig

    phonemes = sorted({label for row in rows for label in row["labels"]} - {"_"})
    voices = sorted({row["voice"] for row in rows})
    return Drama3PhoneCodecConfig(phonemes=["_", *phonemes], voices=voices, **sizes)


def new_codec(rows: list[dict], **sizes):
    from transformers_drama3.codec import Drama3PhoneCodecModel

    torch.manual_seed(0)
    return Drama3PhoneCodecModel(codec_config(rows, **sizes))


def config_of(saved: dict):
    """The codec config a `train` checkpoint was saved with."""
    from transformers_drama3.codec import Drama3PhoneCodecConfig

    return Drama3PhoneCodecConfig(**{k: v for k, v in saved["config"].items() if k in Drama3PhoneCodecConfig.__dataclass_fields__})


def added_decoder_layers(config, saved_config) -> list[int]:
    """The indices of `config`'s decoder layers past those of a checkpoint's `saved_config`, whose
    layers must be the first of them (same dilations and lookaheads, in order)."""
    ours, theirs = config.stack("decoder"), saved_config.stack("decoder")
    count = len(theirs[0])
    if [tuple(pair[:count]) for pair in ours] != [tuple(pair) for pair in theirs]:
        raise ValueError(f"the checkpoint's decoder stack {theirs} is not the first layers of {ours}")
    return list(range(count, len(ours[0])))


def part_parameters(codec, part: str) -> list[torch.nn.Parameter]:
    modules = [getattr(codec, name) for name in PARTS[part]]
    return [p for module in modules if isinstance(module, torch.nn.Module) for p in module.parameters()]


def part_state(codec, part: str) -> dict:
    return {k: v for k, v in codec.state_dict().items() if k.split(".")[0] in PARTS[part]}


def indexed(rows: list[dict], config) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(phoneme ids [frames], voice id, log-mel [n_mels, frames + 4] float32) per row."""
    phoneme_id = {p: i for i, p in enumerate(config.phonemes)}
    voice_id = {v: i for i, v in enumerate(config.voices)}
    return [(torch.tensor([phoneme_id[label] for label in row["labels"]]), voice_id[row["voice"]],
             row["log_mel"].float()) for row in rows]


def batch(data, config, step: int, seed: int, size: int, frames: int, part: str = "recogniser"):
    """Crops of `frames` spectrogram frames with `part`'s receptive field of context on each side
    (what `encode` and `decode` read there: silence and the edge frame's voice past the ends):
    (phonemes [size, left + frames + right], voices [same], log-mel [size, n_mels, same]). A row's
    voice is one id, or one per frame (`recognised_rows`)."""
    rng = random.Random(seed * 1_000_003 + step)
    left, right = config.part_receptive_field(part)
    floor = math.log(config.log_floor)
    phonemes, voices, log_mels = [], [], []
    for _ in range(size):
        labels, voice, log_mel = data[rng.randrange(len(data))]
        count = len(labels)
        start = rng.randrange(max(1, count - frames + 1)) if count > frames else 0
        low, high = start - left, start + frames + right
        window = torch.zeros(high - low, dtype=torch.long)
        inside = slice(max(low, 0), min(high, count))
        window[inside.start - low : inside.stop - low] = labels[inside]
        phonemes.append(window)
        if isinstance(voice, int):
            voices.append(torch.full((high - low,), voice))
        else:
            voices.append(torch.cat([voice[inside.start].expand(inside.start - low), voice[inside],
                                     voice[inside.stop - 1].expand(high - inside.stop)]))
        spectrum = torch.full((config.n_mels, high - low), floor)
        have = slice(max(low, 0), min(high, log_mel.shape[-1]))
        spectrum[:, have.start - low : have.stop - low] = log_mel[:, have]
        log_mels.append(spectrum)
    return torch.stack(phonemes), torch.stack(voices), torch.stack(log_mels)


def spectral_convergence(predicted, target):
    """Relative error of the mel magnitudes (`exp` of the log-mels `[batch, n_mels, frames]`):
    ||exp(target) - exp(predicted)|| / ||exp(target)|| per crop, averaged. Unlike the log-mel L1,
    which weighs every band alike, it is dominated by the loud bands (formants, harmonics)."""
    target, predicted = target.exp(), predicted.exp()
    error = (target - predicted).flatten(1).norm(dim=-1)
    return (error / target.flatten(1).norm(dim=-1).clamp_min(1e-5)).mean()


def train_step_loss(codec, part: str, phonemes, voices, log_mel, spectral_convergence_weight: float = 0.0):
    """The part's loss on a batch (decoder: L1 of the log-mel, plus `spectral_convergence_weight`
    times its `spectral_convergence`; recogniser: cross entropy of the phoneme, half that of the
    voice) and its frame accuracy."""
    left, right = codec.config.part_receptive_field(part)
    inner = slice(left, phonemes.shape[-1] - right)
    if part == "decoder":
        predicted = codec.decode_labels(phonemes, voices)
        loss = (predicted - log_mel[..., inner]).abs().mean()
        if spectral_convergence_weight:
            loss = loss + spectral_convergence_weight * spectral_convergence(predicted, log_mel[..., inner])
        return loss, None
    phoneme_logits, voice_logits = codec.recognise(log_mel)
    loss = F.cross_entropy(phoneme_logits.transpose(1, 2), phonemes[:, inner]) + 0.5 * F.cross_entropy(
        voice_logits.transpose(1, 2), voices[:, inner])
    return loss, (phoneme_logits.argmax(-1) == phonemes[:, inner]).float().mean()


def train(labels: str | Path, out: str | Path, part: str, max_steps: int, minutes: float, resume: bool = False,
          learning_rate: float = 1e-3, batch_size: int = 16, frames: int = 160, seed: int = 0,
          save_minutes: float = 5.0, threads: int = 1, progress: bool = True, stop_at: int | None = None,
          log_every: int = 100, voices: list[str] | None = None, init_from: str | Path | None = None,
          warmup_steps: int | None = None, decoder_dilations: list[int] | None = None,
          decoder_lookahead: int | list[int] | None = None, spectral_convergence_weight: float = 0.0) -> dict:
    """Train `part` of the codec to `max_steps` (or until `minutes` pass, or this sitting reaches
    step `stop_at`); returns the last log line.

    `voices` (corpus voice names) trains on those voices' utterances only; the codec's labels stay
    those of every labelled utterance. `init_from` (a `train` checkpoint of the same part) starts
    from its weights, with a new optimiser and schedule: a fine-tune, e.g. the decoder on the
    bundled model's voices after it learnt all of them. The rate warms up linearly over
    `warmup_steps` (default a tenth of `max_steps`, at most 200), then follows a cosine to zero.

    `decoder_dilations` / `decoder_lookahead` give the decoder its own stack (the codec config's
    fields of those names). With `init_from` a decoder may grow: the checkpoint's layers keep their
    place and weights, and the layers after them start as the identity (their last convolution
    zero), so the fine-tune starts from the checkpoint's output.

    `spectral_convergence_weight` adds the decoder's `spectral_convergence` to its L1 loss."""
    from tqdm import tqdm

    if part not in PARTS:
        raise ValueError(f"part must be one of {sorted(PARTS)}; got {part!r}")
    torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in read_labels(labels) if not r["id"].startswith("heldout")]
    codec = new_codec(rows, decoder_dilations=decoder_dilations, decoder_lookahead=decoder_lookahead)
    if voices is not None:
        rows = [r for r in rows if corpus_voice(r["id"]) in voices]
        if not rows:
            raise ValueError(f"voices {voices}: no labelled utterance of them in {labels}")
    data = indexed(rows, codec.config)
    if init_from is not None and not resume:
        saved = torch.load(init_from, weights_only=False)
        saved_config = config_of(saved)
        for field in ("phonemes", "voices"):
            if list(getattr(saved_config, field)) != list(getattr(codec.config, field)):
                raise ValueError(f"{init_from}: its {field} differ from those of {labels}'s utterances; the codes "
                                 "would change meaning (label the new utterances' phonemes in a new folder)")
        grown = added_decoder_layers(codec.config, saved_config) if part == "decoder" else []
        new_layers = tuple(f"decoder.layers.{index}." for index in grown)
        missing = {key for key in set(part_state(codec, part)) - set(saved["state"]) if not key.startswith(new_layers)}
        if missing:
            raise ValueError(f"{init_from}: not a {part} checkpoint of this size (lacks {sorted(missing)[:3]})")
        codec.load_state_dict(saved["state"], strict=False)
        for index in grown:
            torch.nn.init.zeros_(codec.decoder.layers[index].mix.weight)
            torch.nn.init.zeros_(codec.decoder.layers[index].mix.bias)
    if part == "recogniser" and init_from is None:
        sample = torch.cat([log_mel for _, _, log_mel in data[:500]], dim=-1)
        codec.input_mean.copy_(sample.mean(-1, keepdim=True))
        codec.input_scale.copy_(sample.std(-1, keepdim=True) + 1e-3)
    return fit_part(codec, part, data, out, max_steps, minutes, resume, learning_rate, batch_size, frames, seed,
                    save_minutes, progress, stop_at, log_every, warmup_steps, spectral_convergence_weight)


def fit_part(codec, part: str, data: list, out: Path, max_steps: int, minutes: float, resume: bool,
             learning_rate: float, batch_size: int, frames: int, seed: int, save_minutes: float, progress: bool,
             stop_at: int | None, log_every: int, warmup_steps: int | None,
             spectral_convergence_weight: float = 0.0) -> dict:
    """`train`'s schedule for `part` of `codec` on `data` (`indexed` rows), checkpointed to
    OUT/PART.pt (resumable) and logged to OUT/PART.jsonl; returns the last log line."""
    from tqdm import tqdm

    parameters = part_parameters(codec, part)
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    checkpoint, log_path, step = out / f"{part}.pt", out / f"{part}.jsonl", 0
    if resume and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        if codec.config.stack(part) != config_of(saved).stack(part):
            raise ValueError(f"{checkpoint} has a {part} stack of {config_of(saved).stack(part)}; the sizes given "
                             f"make {codec.config.stack(part)}: resume with the sizes it was started with")
        codec.load_state_dict(saved["state"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    elif not resume and checkpoint.exists():
        raise FileExistsError(f"{checkpoint} exists: pass --resume to continue it, or choose another --out")

    def save():
        temporary = checkpoint.with_suffix(".tmp")
        torch.save({"state": part_state(codec, part), "optimizer": optimizer.state_dict(), "step": step,
                    "config": codec.config.to_dict()}, temporary)
        os.replace(temporary, checkpoint)

    start = last_save = time.time()
    line, window = {}, []
    warmup = min(200, max(1, max_steps // 10)) if warmup_steps is None else max(1, warmup_steps)
    bar = tqdm(total=max_steps, initial=step, desc=f"training the {part}", disable=not progress, mininterval=30)
    codec.train()
    end = max_steps if stop_at is None else min(stop_at, max_steps)
    while step < end and time.time() - start < minutes * 60:
        rate = learning_rate * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / max_steps))
        for group in optimizer.param_groups:
            group["lr"] = rate
        loss, accuracy = train_step_loss(codec, part, *batch(data, codec.config, step, seed, batch_size, frames, part),
                                         spectral_convergence_weight=spectral_convergence_weight)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        bar.update()
        window.append((float(loss.detach()), None if accuracy is None else float(accuracy)))
        if step % log_every == 0 or step == max_steps:  # means over the steps since the last line
            line = {"step": step, "loss": round(float(np.mean([w[0] for w in window])), 4),
                    "seconds": round(time.time() - start, 1)}
            if window[0][1] is not None:
                line["frame_accuracy"] = round(float(np.mean([w[1] for w in window])), 4)
            with open(log_path, "a") as log:
                log.write(json.dumps(line) + "\n")
            window = []
        if time.time() - last_save > save_minutes * 60:
            save()
            last_save = time.time()
    bar.close()
    save()
    return line


def recognised_rows(codec, rows: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(phoneme ids [frames], voice ids [frames], log-mel [n_mels, frames + 4] float32) per row: the
    codes `encode` gives the row's speech (what the decoder reads in a resynthesis, and what the
    language model learnt to write), per spectrogram frame; rows with the same id are read once."""
    left, right = codec.config.receptive_field
    done = {}
    for row in rows:
        if row["id"] in done:
            continue
        log_mel = row["log_mel"].float()
        frames = log_mel.shape[-1] - 4
        padded = torch.cat([codec.silent_log_mel(1, left)[0], log_mel, codec.silent_log_mel(1, right - 4)[0]], dim=-1)
        with torch.no_grad():
            phonemes, voices = codec.code_frames(codec.encode_log_mel(padded[None]))
        if phonemes.shape[-1] != frames:
            raise ValueError(f"{row['id']}: {frames} labelled frames, but its speech encodes to {phonemes.shape[-1]}")
        done[row["id"]] = (phonemes[0], voices[0], log_mel)
    return [done[row["id"]] for row in rows]


def finetune_decoder(codec_path: str | Path, labels: str | Path, out: str | Path, max_steps: int, minutes: float,
                     resume: bool = False, extra_labels: str | Path | None = None, extra_repeat: int = 1,
                     voices: list[str] | None = None, codes: str = "recognised", learning_rate: float = 1e-4,
                     batch_size: int = 8, frames: int = 320, seed: int = 0, warmup_steps: int | None = None,
                     save_minutes: float = 5.0, threads: int = 1, progress: bool = True, stop_at: int | None = None,
                     log_every: int = 100) -> dict:
    """Fine-tune the decoder of the saved codec `codec_path` (its recogniser and labels unchanged)
    on the utterances of `labels` (of `voices` only, when given) plus those of `extra_labels`
    repeated `extra_repeat` times (e.g. everyday sentences labelled with `label --sentences`), with
    `train`'s schedule, resumable. `codes`: what the decoder reads, "recognised" (the codec's own
    codes of the speech, `recognised_rows`) or "labels" (the event labels `train` uses). An
    utterance with a phoneme the codec lacks is left out. When done, OUT/codec is the codec with
    the new decoder; returns the last log line."""
    from transformers import AutoModel

    import transformers_drama3  # noqa: F401  (registers the codec types)

    if codes not in ("recognised", "labels"):
        raise ValueError(f"codes must be 'recognised' or 'labels'; got {codes!r}")
    if extra_repeat < 1:
        raise ValueError(f"extra_repeat {extra_repeat}: expected at least 1")
    torch.set_num_threads(threads)
    out = Path(out)
    codec = AutoModel.from_pretrained(codec_path).eval()
    if codec.config.model_type != "drama3_phone_codec":
        raise ValueError(f"{codec_path}: a {codec.config.model_type} codec; only a phonetic codec has a label decoder")

    def chosen(folder):
        return [r for r in read_labels(folder) if not r["id"].startswith("heldout")
                and (voices is None or corpus_voice(r["id"]) in voices)]

    rows = chosen(labels) + (chosen(extra_labels) * extra_repeat if extra_labels is not None else [])
    known = set(codec.config.phonemes)
    kept = [row for row in rows if known.issuperset(row["labels"])]
    if not kept:
        raise ValueError(f"no labelled utterance of {labels} (voices {voices}) that the codec can say")
    if len(kept) < len(rows):
        print(f"{len(rows) - len(kept)} of {len(rows)} rows left out: phonemes the codec lacks", flush=True)
    data = recognised_rows(codec, kept) if codes == "recognised" else indexed(kept, codec.config)
    out.mkdir(parents=True, exist_ok=True)
    line = fit_part(codec, "decoder", data, out, max_steps, minutes, resume, learning_rate, batch_size, frames, seed,
                    save_minutes, progress, stop_at, log_every, warmup_steps)
    if torch.load(out / "decoder.pt", weights_only=False)["step"] >= max_steps:
        codec.eval()
        temporary = out / "codec.tmp"
        codec.save_pretrained(temporary)
        if (out / "codec").exists():
            shutil.rmtree(out / "codec")
        os.replace(temporary, out / "codec")
    return line


def export(labels: str | Path, out: str | Path) -> Path:
    """RUN/decoder.pt + RUN/recogniser.pt -> the codec folder RUN/codec."""
    out = Path(out)
    rows = [r for r in read_labels(labels) if not r["id"].startswith("heldout")]
    checkpoints = {part: torch.load(out / f"{part}.pt", weights_only=False) for part in PARTS}
    decoder = config_of(checkpoints["decoder"])
    codec = new_codec(rows, decoder_dilations=decoder.decoder_dilations, decoder_lookahead=decoder.decoder_lookahead).eval()
    for part, saved in checkpoints.items():
        missing = set(part_state(codec, part)) - set(saved["state"])
        if missing:
            raise ValueError(f"{out / f'{part}.pt'} lacks {sorted(missing)[:3]}")
        codec.load_state_dict(saved["state"], strict=False)
        print(f"{part}: step {saved['step']}")
    codec.save_pretrained(out / "codec")
    return out / "codec"


# ---- evaluation -----------------------------------------------------------------------------------

def evaluate(codec_path: str | Path, voices: str = "A,B,D,F", progress: bool = True) -> dict:
    """Whisper WER per voice on `drama3 eval`'s held-out sentences, spoken by libespeak-ng: the
    originals, their resyntheses through the codec (encode -> decode), and the decoder given the
    true phoneme labels (what a model that predicts the codes exactly would sound like)."""
    from tqdm import tqdm
    from transformers import AutoModel

    from transformers_drama3.evaluation.asr import transcribe, word_errors

    from .corpus import VOICES_BY_NAME

    codec = AutoModel.from_pretrained(codec_path).eval()
    unknown = sorted({voice_label(text, VOICES_BY_NAME[name]) for _, text, name in heldout_items(voices)}
                     - set(codec.config.voices))
    if unknown:
        raise ValueError(f"{codec_path}: the codec was not trained on the voices {unknown}; it knows {codec.config.voices}")
    phoneme_id = {p: i for i, p in enumerate(codec.config.phonemes)}
    voice_id = {v: i for i, v in enumerate(codec.config.voices)}
    edits: dict[tuple[str, str], list[int]] = {}
    takes = []
    for uid, text, name in tqdm(heldout_items(voices), desc="held-out", disable=not progress):
        voice = VOICES_BY_NAME[name]
        samples, phonemes = aligned_segments_synthesize(text, voice)
        audio = samples.astype(np.float32) / 32768.0
        frames = -(-len(samples) // codec.hop_length)
        labels = frame_labels(samples, phonemes, frames * codec.config.mel_frames_per_frame)
        m = codec.config.mel_frames_per_frame
        ids = torch.tensor([phoneme_id.get(label, 0) for label in labels]).reshape(frames, m)
        true_codes = torch.cat([ids[:, :1], torch.full((frames, 1), voice_id[voice_label(text, voice)]),
                                ids[:, 1:]], dim=1).T[None]
        with torch.no_grad():
            encoded = codec.encode(audio, sampling_rate=codec.sampling_rate)
            outputs = {"original": audio, "resynthesis": codec.decode(encoded.audio_codes).audio_values[0].numpy(),
                       "true labels": codec.decode(true_codes).audio_values[0].numpy()}
        take = {"id": uid, "text": text, "voice": name,
                "frame_accuracy": float((encoded.audio_codes[0] == true_codes[0]).float().mean())}
        for kind, waveform in outputs.items():
            heard = transcribe(waveform, codec.sampling_rate)
            errors, words = word_errors(heard, text)
            edits.setdefault((kind, name), [0, 0])
            edits[(kind, name)][0] += errors
            edits[(kind, name)][1] += words
            take[f"heard {kind}"] = heard
        takes.append(take)
    table = {kind: {name: edits[(kind, name)][0] / edits[(kind, name)][1] for name in voices.split(",")}
             for kind in ("original", "resynthesis", "true labels")}
    for kind, per_voice in table.items():
        total = [sum(edits[(kind, n)][i] for n in voices.split(",")) for i in (0, 1)]
        per_voice["all"] = total[0] / total[1]
    return {"wer": table, "code_accuracy": float(np.mean([t["frame_accuracy"] for t in takes])), "takes": takes}


def print_table(result: dict) -> None:
    voices = [v for v in next(iter(result["wer"].values())) if v != "all"]
    print("| audio | " + " | ".join(voices) + " | all |")
    print("|---|" + "---|" * (len(voices) + 1))
    for kind, per_voice in result["wer"].items():
        print(f"| {kind} | " + " | ".join(f"{100 * per_voice[v]:.1f}%" for v in [*voices, "all"]) + " |")
    print(f"codes equal to the true labels' (resynthesis): {100 * result['code_accuracy']:.1f}%")


def integers(text: str | None) -> list[int] | None:
    return None if text is None else [int(part) for part in text.split(",")]


def lookahead_argument(text: str | None) -> int | list[int] | None:
    values = integers(text)
    return values[0] if values is not None and len(values) == 1 else values


def schedule_arguments(p, max_steps: int, learning_rate: float, batch_size: int, frames: int) -> None:
    """The options of `fit_part`'s schedule and data that `train` and `finetune` share, with their defaults."""
    p.add_argument("--max-steps", type=int, default=max_steps)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--learning-rate", type=float, default=learning_rate)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--frames", type=int, default=frames)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=None, help="end this sitting at this step (resume later)")
    p.add_argument("--voices", default=None, help="train on these corpus voices' utterances only (e.g. A,B)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of --max-steps, at most 200")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.phone_codec_fit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("label", help="speak the corpus's train texts (or a file of sentences) with phoneme labels")
    p.add_argument("--corpus", default=None)
    p.add_argument("--sentences", default=None,
                   help="instead of a corpus: a file of sentences, one a line; its first --utterances, in each --voices")
    p.add_argument("--out", required=True)
    p.add_argument("--utterances", type=int, default=7000)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--voices", default=None, help="label these corpus voices' utterances only (e.g. A,B)")
    p.add_argument("--tag", default=None,
                   help="add shards labels-TAG-*.pt to a labelled folder, of utterances its first shards lack")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    p = sub.add_parser("train", help="train the decoder or the recogniser")
    p.add_argument("--labels", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    schedule_arguments(p, max_steps=3000, learning_rate=1e-3, batch_size=16, frames=160)
    p.add_argument("--init-from", default=None,
                   help="start from this checkpoint of the part (RUN/decoder.pt), with a new schedule: a fine-tune")
    p.add_argument("--decoder-dilations", default=None,
                   help="the decoder's own layers, e.g. 1,2,4,8,1,2,4,8,16,32 (default: the recogniser's)")
    p.add_argument("--decoder-lookahead", default=None,
                   help="spectrogram frames each decoder layer looks ahead: one number, or one per layer")
    p.add_argument("--spectral-convergence", type=float, default=0.0,
                   help="weight of the decoder's spectral-convergence loss (mel magnitudes) beside its log-mel L1")
    p = sub.add_parser("finetune", help="fine-tune a saved codec's decoder; RUN/codec is the codec with the new one")
    p.add_argument("--codec", required=True, help="the saved codec folder to start from")
    p.add_argument("--labels", required=True)
    p.add_argument("--extra-labels", default=None, help="a second labelled folder, e.g. of `label --sentences`")
    p.add_argument("--extra-repeat", type=int, default=1, help="how many times the extra utterances count")
    p.add_argument("--codes", choices=["recognised", "labels"], default="recognised",
                   help="what the decoder reads: the codec's own codes of the speech, or the event labels")
    p.add_argument("--out", required=True)
    schedule_arguments(p, max_steps=2000, learning_rate=1e-4, batch_size=8, frames=320)
    p = sub.add_parser("export", help="both halves into RUN/codec")
    p.add_argument("--labels", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("evaluate", help="Whisper WER of originals, resyntheses and true-label decodings")
    p.add_argument("--codec", required=True)
    p.add_argument("--voices", default="A,B,D,F")
    p.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.command == "label":
        if args.utterances < 1 or args.jobs < 1:
            parser.error("--utterances and --jobs must be >= 1")
        if (args.corpus is None) == (args.sentences is None):
            parser.error("give --corpus or --sentences (one of them)")
        voices = args.voices.split(",") if args.voices else None
        if args.shard is not None:
            label_shard(args.corpus and Path(args.corpus), Path(args.out), args.utterances, args.shard, args.jobs,
                        voices, args.tag, args.sentences)
        else:
            print("\n".join(str(p) for p in label(args.corpus, args.out, args.utterances, args.jobs, voices, args.tag,
                                                   args.sentences)))
    elif args.command == "train":
        if args.max_steps < 1 or args.minutes <= 0:
            parser.error("--max-steps must be >= 1 and --minutes > 0")
        if not math.isfinite(args.spectral_convergence) or args.spectral_convergence < 0:
            parser.error("--spectral-convergence must be a finite weight >= 0")
        print(train(args.labels, args.out, args.part, args.max_steps, args.minutes, args.resume, args.learning_rate,
                    args.batch_size, args.frames, args.seed, threads=args.threads, stop_at=args.stop_at,
                    voices=args.voices.split(",") if args.voices else None, init_from=args.init_from,
                    warmup_steps=args.warmup_steps, decoder_dilations=integers(args.decoder_dilations),
                    decoder_lookahead=lookahead_argument(args.decoder_lookahead),
                    spectral_convergence_weight=args.spectral_convergence))
    elif args.command == "finetune":
        if args.max_steps < 1 or args.minutes <= 0 or args.extra_repeat < 1:
            parser.error("--max-steps and --extra-repeat must be >= 1 and --minutes > 0")
        print(finetune_decoder(args.codec, args.labels, args.out, args.max_steps, args.minutes, args.resume,
                               args.extra_labels, args.extra_repeat, args.voices.split(",") if args.voices else None,
                               args.codes, args.learning_rate, args.batch_size, args.frames, args.seed,
                               args.warmup_steps, threads=args.threads, stop_at=args.stop_at))
    elif args.command == "export":
        print(f"codec saved to {export(args.labels, args.out)}")
    else:
        result = evaluate(args.codec, args.voices)
        print_table(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
