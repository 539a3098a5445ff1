"""Decode speed of Drama 3 generation on this machine (random weights, float32).

    PYTHONPATH=src python benchmarks/generate.py [--configs small medium] [--batches 1 4 16]
                                                 [--frames 16] [--prompt-rows 128] [--threads N]

For each config prints:
  - prefill time of one prompt of `--prompt-rows` rows;
  - frames per second of one stream and of batches of 4 and 16 (frames of all items / time);
  - time to first audio of one stream: prefill + the first 10-frame window + its codec decode
    (the codec at its published sizes, random weights);
  - decode time per frame (batch 1) against the memory-bandwidth floor: the bytes of weights
    one frame reads (backbone without the unused routed experts, the top-k experts of each
    layer, the restricted lm_head rows, the whole tower and its heads) divided by the copy
    bandwidth measured here. A ratio of 1 would be a decode bound only by reading weights.
eos is masked out so every run makes exactly `--frames` frames. Prints only; asserts nothing.
"""

import argparse
import time

import torch

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.generation_drama3 import Drama3Sampler, SamplingSettings, decode_steps, prompt_window

CONFIGS = {
    # ~20M parameters: the tiny test model's shape, a little wider
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, expert_size=256,
                  tower_ffn=512, codebook=1024, vocab=2048),
    # ~0.9B parameters: 1/2 of the published width, 8 of 40 layers, the published codebooks
    "medium": dict(hidden=1024, layers=8, heads=8, kv_heads=2, head_dim=128, experts=64, top_k=8, expert_size=256,
                   tower_ffn=3072, codebook=4096, vocab=8192),
}


def build(name: str) -> Drama3ForSpeechGeneration:
    size = CONFIGS[name]
    text = dict(
        hidden_size=size["hidden"], num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"], vocab_size=size["vocab"] + size["codebook"],
        linear_num_key_heads=size["heads"], linear_num_value_heads=2 * size["heads"], linear_key_head_dim=size["head_dim"],
        linear_value_head_dim=size["head_dim"], num_experts=size["experts"], num_experts_per_tok=size["top_k"],
        moe_intermediate_size=size["expert_size"], shared_expert_intermediate_size=size["expert_size"],
        max_position_embeddings=4096,
    )
    tower = dict(dim=size["hidden"], n_head=size["heads"], n_local_heads=size["kv_heads"], head_dim=size["head_dim"],
                 intermediate_size=size["tower_ffn"], vocab_size=size["codebook"], num_codebooks=10)
    config = Drama3Config(text_config=text, audio_decoder_config=tower, semantic_start_token_id=size["vocab"],
                          eos_token_id=2)
    model = Drama3ForSpeechGeneration(config).float().eval()
    eos_index = config.codebook_size  # the restricted logits end with eos: mask it so runs never stop early
    speech_logits = model.speech_logits

    def without_eos(hidden):
        logits = speech_logits(hidden)
        logits[..., eos_index] = float("-inf")
        return logits

    model.speech_logits = without_eos
    return model


def weights_read_per_frame(model: Drama3ForSpeechGeneration) -> int:
    """Bytes of parameters one decode step reads (batch 1)."""
    text = model.config.text_config
    element = next(model.parameters()).element_size()
    total = 0
    for name, parameter in model.named_parameters():
        if name.startswith(("lm_head", "audio_decoder.codebook_embeddings")) or "embed_tokens" in name:
            continue
        if "embedding" in name:  # tower embeddings: one row each
            total += parameter.shape[-1] * element
        elif ".mlp.experts." in name:
            total += parameter.numel() * element * text.num_experts_per_tok // text.num_experts
        else:
            total += parameter.numel() * element
    rows = model.config.codebook_size + 1
    total += rows * model.config.hidden_size * element  # restricted lm_head
    total += (1 + model.config.num_codebooks) * model.config.hidden_size * element  # embedding rows of one row
    return total


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes read per second by a large tensor copy (best of 5)."""
    source = torch.empty(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return source.numel() * 4 / best


def prompt_of(model, batch: int, rows: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.semantic_start_token_id, (batch, rows), generator=generator)
    return input_ids, torch.zeros(batch, rows, model.config.num_codebooks, dtype=torch.long), torch.ones_like(input_ids)


def run(model, batch: int, rows: int, frames: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for `frames` frames of a batch."""
    input_ids, audio_codes, mask = prompt_of(model, batch, rows)
    sampler = Drama3Sampler(SamplingSettings(), model.speech_token_ids(), prompt_window(input_ids, mask))
    budgets = torch.full((batch,), frames)
    started = time.perf_counter()
    steps = decode_steps(model, input_ids, audio_codes, mask, sampler, budgets)
    next(steps)  # prefill + first frame
    first = time.perf_counter()
    for _ in steps:
        pass
    done = time.perf_counter()
    per_frame = (done - first) / max(frames - 1, 1)
    return first - started - per_frame, per_frame


def time_to_first_audio(model, rows: int) -> float:
    from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel

    codec = Drama3CodecModel(Drama3CodecConfig(semantic_codebook_size=model.config.codebook_size)).eval()
    input_ids, audio_codes, mask = prompt_of(model, 1, rows)
    for chunk in model.stream(input_ids, audio_codes, mask, codec=codec, seed=0, max_new_tokens=10):
        return chunk.elapsed
    return float("nan")


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--prompt-rows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-codec", action="store_true", help="skip the time-to-first-audio run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth()
    print(f"threads {torch.get_num_threads()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s read")
    for name in args.configs:
        torch.manual_seed(0)
        model = build(name)
        parameters = sum(p.numel() for p in model.parameters())
        weights = weights_read_per_frame(model)
        print(f"\n[{name}] {parameters / 1e6:.0f}M parameters, {weights / 1e6:.0f} MB of weights read per frame")
        run(model, 1, 8, 2)  # warm-up
        per_frame_single = None
        for batch in args.batches:
            prefill, per_frame = run(model, batch, args.prompt_rows, args.frames)
            if batch == 1:
                per_frame_single = per_frame
                print(f"  prefill of {args.prompt_rows} rows: {prefill * 1e3:.0f} ms")
            print(f"  batch {batch:>2}: {batch / per_frame:7.1f} frames/s ({per_frame * 1e3:.0f} ms per step)")
        if per_frame_single is not None:
            floor = weights / bandwidth
            print(f"  decode per frame {per_frame_single * 1e3:.1f} ms vs bandwidth floor {floor * 1e3:.2f} ms "
                  f"({floor / per_frame_single:.1%} of the floor's speed)")
        if not args.no_codec:
            print(f"  time to first audio (10 frames + codec window): {time_to_first_audio(model, args.prompt_rows):.2f} s")


if __name__ == "__main__":
    main()
