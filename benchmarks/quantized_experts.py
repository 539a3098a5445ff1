"""What quantising the weights costs: each option against the dense model, on the CPU.

    python -m benchmarks.quantized_experts                 # error table (about a minute)
    python -m benchmarks.quantized_experts --speech        # + drama3-tiny WER / speaker similarity (~15 min)

Error table. drama3-tiny (the bundled trained model, published layout) is written as two
checkpoints: bfloat16 tensors, and bfloat16 with its routed experts in block-FP8 (128 x 128, the
published format). Each is loaded dense in float32 (the reference) and quantised under each option
(`quantization_config_for`: torchao int8 / int4, bitsandbytes nf4 / 8-bit; computing in float32
so that only the weights differ). For a prompt (a bundled voice's reference and a sentence) it prints:
  - the teacher-forced logits' largest absolute error and relative error ||q - ref|| / ||ref||,
    for the backbone's logits and the tower's codebook logits;
  - greedy frame agreement: the share of the dense model's greedy frames (all codes) the quantised
    model reproduces at the same position, and the first frame where they part;
  - the memory the model holds (`weights.held_bytes`: parameters, buffers, quantiser states) and
    its ratio to the dense float32 model (drama3-tiny's tower, embeddings and head, kept in float32
    here, are most of its bytes; in the published model the routed experts are), beside `weights.quantized_bytes`' prediction for the
    quantised linears.

--speech: every bundled voice speaks the held-out sentences (`evaluation.intelligibility`) with
the float32 model and with each option, the same seeds; Whisper tiny.en's WER of the outputs, and
resemblyzer speaker similarity of each output to its voice's reference clip and to the float32
model's output of the same take (the [eval] extra and espeak-ng). `drama3 eval --quant OPTION`
gives the WER table of one option.

Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration, Drama3Processor
from transformers_drama3.checkpoint.quantization import is_routed_expert_weight, quantize_block_fp8
from transformers_drama3.checkpoint.quantization.quantized_loading import (
    WEIGHT_OPTIONS,
    int4_group_size,
    quantization_config_for,
)
from transformers_drama3.checkpoint.quantization.weights import held_bytes, quantized_bytes
from transformers_drama3.tiny import shipped

BLOCK_FP8 = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
SENTENCE = "The kettle was still warm when she came back in from the garden."


def write_checkpoints(root: Path) -> dict[str, Path]:
    """drama3-tiny as a bfloat16 checkpoint and as one with block-FP8 routed experts."""
    source = Path(shipped.TINY_MODEL_PATH)
    tensors = load_file(source / "model.safetensors")
    folders = {}
    for kind in ("bf16", "fp8"):
        folder = root / kind
        folder.mkdir(parents=True)
        settings = Drama3Config.from_pretrained(source).to_dict()
        config = Drama3Config(**{**settings, **({"quantization_config": BLOCK_FP8} if kind == "fp8" else {})})
        config.dtype = torch.bfloat16
        config.save_pretrained(folder)
        written = {}
        for name, tensor in tensors.items():
            if name.endswith(".linear_attn.A_log"):
                written[name] = tensor.float()
            elif kind == "fp8" and is_routed_expert_weight(name):
                written[name], written[name + "_scale_inv"] = quantize_block_fp8(tensor)
            else:
                written[name] = tensor.to(torch.bfloat16)
        save_file(written, folder / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(source / "generation_config.json", folder)  # its sampler and phoneme-alignment table
        folders[kind] = folder
    return folders


def load(folder: Path, option: str | None, dtype=torch.float32):
    if option is None:
        return Drama3ForSpeechGeneration.from_pretrained(folder, dtype=dtype).eval()
    config = Drama3Config.from_pretrained(folder)
    quantization = quantization_config_for(option, config, device="cpu", dtype=dtype)
    return Drama3ForSpeechGeneration.from_pretrained(folder, dtype=dtype, quantization_config=quantization).eval()


def greedy_frames(model, inputs, frames: int) -> torch.Tensor:
    out = model.generate(**inputs, do_sample=False, max_new_tokens=frames, return_dict_in_generate=True)
    return out.audio_codes[0, : int(out.lengths[0])]


def predicted_linear_bytes(model, option: str) -> tuple[int, int]:
    """(held, `quantized_bytes` predicted) over the model's quantised linears."""
    held, group = held_bytes(model), int4_group_size(model.config)
    actual = predicted = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, "in_features") or type(weight) in (torch.Tensor, torch.nn.Parameter):
            continue
        actual += held[name + ".weight"]
        predicted += quantized_bytes((module.out_features, module.in_features), option, device="cpu", dtype=torch.float32, group_size=group)
    return actual, predicted


def error_table(frames: int) -> None:
    processor = Drama3Processor.from_pretrained(shipped.TINY_MODEL_PATH)
    clip, transcript = shipped.reference_voice("A")
    inputs = processor(SENTENCE, reference_audio=[clip], reference_text=[transcript])
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        folders = write_checkpoints(Path(directory))
        for kind, folder in folders.items():
            reference = load(folder, None)
            dense = sum(held_bytes(reference).values())
            with torch.no_grad():
                expected = reference(inputs["input_ids"], inputs["audio_codes"], attention_mask=inputs["attention_mask"])
            expected_frames = greedy_frames(reference, inputs, frames)
            for option in WEIGHT_OPTIONS:
                model = load(folder, option)
                with torch.no_grad():
                    got = model(inputs["input_ids"], inputs["audio_codes"], attention_mask=inputs["attention_mask"])
                model_frames = greedy_frames(model, inputs, frames)
                same = min(len(model_frames), len(expected_frames))
                equal = (model_frames[:same] == expected_frames[:same]).all(dim=-1)
                first_diff = int((~equal).nonzero()[0]) if not bool(equal.all()) else same
                held = sum(held_bytes(model).values())
                linear_held, linear_predicted = predicted_linear_bytes(model, option)
                rows.append((
                    kind, option,
                    float((got.logits - expected.logits).abs().max()),
                    float((got.logits - expected.logits).norm() / expected.logits.norm()),
                    float((got.codebook_logits - expected.codebook_logits).norm() / expected.codebook_logits.norm()),
                    f"{int(equal.sum())}/{len(expected_frames)}", first_diff, held / 2**20, held / dense,
                    linear_predicted / linear_held,
                ))
    print(f"drama3-tiny, prompt: voice A + {SENTENCE!r}; {frames} greedy frames; weights computed in float32")
    print("| checkpoint | option | logits max abs err | logits rel err | codebook logits rel err | greedy frames equal "
          "| first differing frame | held MiB | held / dense float32 | quantized_bytes / held (quantised linears) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]:.4f} | {row[3]:.4f} | {row[4]:.4f} | {row[5]} | {row[6]} | {row[7]:.1f} "
              f"| {row[8]:.2f} | {row[9]:.3f} |")
    print(f"dense float32 model: {dense / 2**20:.1f} MiB")


def speech_table(sentences: int, seed: int) -> None:
    from recipes.drama3_tiny import instruments
    from transformers_drama3.evaluation import asr
    from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES, speak_with_model
    from tqdm.auto import tqdm

    processor = Drama3Processor.from_pretrained(shipped.TINY_MODEL_PATH)
    voices = {name: shipped.reference_voice(name) for name in shipped.voices()}
    rate = processor.codec.sampling_rate
    references = {name: instruments.speaker_embedding(*_read(clip)) for name, (clip, _) in voices.items()}
    texts = list(HELDOUT_SENTENCES[:sentences])
    outputs: dict[str | None, list] = {}
    for option in (None, *WEIGHT_OPTIONS):
        model = load(Path(shipped.TINY_MODEL_PATH), option)
        takes = []
        for name, reference in tqdm(voices.items(), desc=option or "float32"):
            for index, text in enumerate(texts):
                audio, finish = speak_with_model(model, processor, text, reference, seed + index)
                takes.append({"voice": name, "text": text, "audio": audio, "heard": asr.transcribe(audio, rate),
                              "embedding": instruments.speaker_embedding(audio, rate)})
        outputs[option] = takes
    print(f"drama3-tiny, voices {', '.join(voices)} x {len(texts)} held-out sentences, seeds {seed}..; float32 compute")
    print("| weights | WER (Whisper tiny.en) | similarity to the voice's reference | similarity to float32's take |")
    print("|---|---|---|---|")
    for option, takes in outputs.items():
        wer = asr.corpus_wer([(take["heard"], take["text"]) for take in takes])
        to_voice = np.mean([instruments.speaker_similarity(t["embedding"], references[t["voice"]]) for t in takes])
        to_float = np.mean([
            instruments.speaker_similarity(t["embedding"], f["embedding"]) for t, f in zip(takes, outputs[None])
        ])
        print(f"| {option or 'float32'} | {wer:.1%} | {to_voice:.3f} | {to_float:.3f} |")


def _read(path: str):
    import soundfile

    audio, rate = soundfile.read(path, dtype="float32")
    return audio, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=40, help="greedy frames compared per option")
    parser.add_argument("--speech", action="store_true", help="also the drama3-tiny WER / speaker similarity table")
    parser.add_argument("--sentences", type=int, default=12, help="held-out sentences per voice for --speech")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    error_table(args.frames)
    if args.speech:
        speech_table(args.sentences, args.seed)


if __name__ == "__main__":
    main()
