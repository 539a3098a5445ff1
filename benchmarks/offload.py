"""Decode speed with the routed experts offloaded (`offload_experts`) against the resident model, in one run.

    PYTHONPATH=src python benchmarks/offload.py                      # CUDA when present, else the CPU
    PYTHONPATH=src python benchmarks/offload.py --cache 8 32 128 --layers 4 --frames 32
    PYTHONPATH=src python benchmarks/offload.py --dry-run            # a tiny width, seconds (checks the script)

Builds a random model (bfloat16 on CUDA, float32 on the CPU) at the published width (hidden 2048,
256 experts of which 8 per token, the 13-layer tower, the full vocabulary) with `--layers` backbone
layers (the published 40 take minutes to build; the per-layer cost is what offload changes), or,
on the CPU, at `--width small` (hidden 256, 64 experts) unless `--width published` is asked for.
eos is masked out, so every run makes `--frames` frames of greedy decode at batch 1 from a prompt
of `--prompt-rows` rows. It prints, for the resident model and for each `--cache` size (experts of
each layer kept on the device):

  frames/s, the ratio to the resident model, and the cache's hit rate and bytes copied per frame
  (host to device) over the timed run.

The timed run follows one untimed warm-up run of the same prompt (so the cache starts warm from a
different draw of the same prompt, as in a long session). Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration, expert_cache_stats, offload_experts
from transformers_drama3.layers.offloaded_experts import ExpertCacheStats

WIDTHS = {
    "published": (dict(num_experts=256, num_experts_per_tok=8), {}),
    "small": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                   linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=64,
                   num_experts_per_tok=8, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                   vocab_size=4096 + 1024),
              dict(dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024)),
    "dry-run": (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     vocab_size=512 + 256),
                dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)),
}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", nargs="+", type=int, default=None,
                        help="experts of each layer cached on the device (default: top-k, 4 x top-k, half of them)")
    parser.add_argument("--layers", type=int, default=4, help="backbone layers (multiple of 4)")
    parser.add_argument("--frames", type=int, default=32, help="frames per timed run")
    parser.add_argument("--prompt-rows", type=int, default=64)
    parser.add_argument("--width", choices=["published", "small"], default=None,
                        help="model width (default: published on CUDA, small on the CPU)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny width, 2 frames: checks the script runs")
    arguments = parser.parse_args(argv)
    if arguments.layers < 4 or arguments.layers % 4:
        parser.error(f"--layers {arguments.layers}: expected a positive multiple of 4 (3 Gated DeltaNet : 1 attention)")
    for name in ("frames", "prompt_rows"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(arguments, name)}: expected a positive number")
    if arguments.cache is not None and min(arguments.cache) < 1:
        parser.error(f"--cache {arguments.cache}: expected positive numbers of experts")
    return arguments


def build(width: str, layers: int, device: torch.device) -> Drama3ForSpeechGeneration:
    """A random model of `width` with `layers` backbone layers; eos masked out of the main token."""
    text, tower = (dict(part) for part in WIDTHS[width])
    text["num_hidden_layers"] = layers
    if width == "published":
        config = Drama3Config(text_config=text)
    else:
        codebook = tower["vocab_size"]
        config = Drama3Config(text_config=text, audio_decoder_config=tower,
                              semantic_start_token_id=text["vocab_size"] - codebook, eos_token_id=2)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Drama3ForSpeechGeneration(config).to(dtype).eval()  # built on the CPU: offload starts there
    eos_index = config.codebook_size
    speech_logits = model.speech_logits

    def without_eos(hidden):
        logits = speech_logits(hidden)
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_index
        return logits.masked_fill(is_eos, float("-inf"))

    model.speech_logits = without_eos
    return model


def prompt(config: Drama3Config, rows: int, device: torch.device, seed: int):
    """A random prompt of text rows then audio rows: input_ids [1, rows], audio_codes [1, rows, C]."""
    generator = torch.Generator().manual_seed(seed)
    text_rows = rows // 2
    codes = torch.zeros(1, rows, config.num_codebooks, dtype=torch.long)
    codes[0, text_rows:] = torch.randint(0, config.codebook_size, (rows - text_rows, config.num_codebooks), generator=generator)
    ids = torch.randint(3, config.semantic_start_token_id, (1, rows), generator=generator)
    ids[0, text_rows:] = config.semantic_start_token_id + codes[0, text_rows:, 0]
    return ids.to(device), codes.to(device)


def timed_run(model, config, arguments, device):
    """(frames/s, frames made, the expert caches' counters over the timed run) after one untimed
    warm-up run of another prompt."""
    for seed in (0, 1):
        ids, codes = prompt(config, arguments.prompt_rows, device, seed)
        before = expert_cache_stats(model)
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, codes, do_sample=False, max_new_tokens=arguments.frames, return_dict_in_generate=True)
        synchronize(device)
        elapsed = time.perf_counter() - start
    after = expert_cache_stats(model)
    timed = ExpertCacheStats(**{name: getattr(after, name) - getattr(before, name) for name in vars(after)})
    frames = int(out.lengths[0])
    return frames / elapsed, frames, timed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width = "dry-run" if arguments.dry_run else arguments.width or ("published" if device.type == "cuda" else "small")
    if arguments.dry_run:
        arguments.frames, arguments.prompt_rows = 2, 8
    resident = build(width, arguments.layers, device)
    config, text = resident.config, resident.config.text_config
    caches = arguments.cache or sorted({text.num_experts_per_tok, 4 * text.num_experts_per_tok, text.num_experts // 2})
    print(f"{device.type}, {width} width, {arguments.layers} layers, {text.num_experts} experts ({text.num_experts_per_tok} "
          f"per token), {next(resident.parameters()).dtype}; batch 1, prompt {arguments.prompt_rows} rows, "
          f"{arguments.frames} frames greedy")
    offloaded = {cache: offload_experts(copy.deepcopy(resident), cache_experts=cache, device=device) for cache in caches}
    resident.to(device)
    base, frames, _ = timed_run(resident, config, arguments, device)
    print(f"  resident                      {base:8.2f} frames/s  ({frames} frames)")
    for cache, model in offloaded.items():
        speed, frames, stats = timed_run(model, config, arguments, device)
        rate = stats.hits / max(1, stats.hits + stats.misses)
        print(f"  offloaded, {cache:4d} cached/layer {speed:8.2f} frames/s  {speed / base:6.3f}x resident  "
              f"hit rate {rate:.2f}  {stats.copied_bytes / max(1, frames) / 1e6:.1f} MB copied per frame  ({frames} frames)")


if __name__ == "__main__":
    main()
