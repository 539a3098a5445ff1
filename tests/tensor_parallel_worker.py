"""Run by tests/test_scale_out_inference.py under torch.distributed.run (2 gloo processes): load a
checkpoint with transformers' tensor-parallel plan (`DistributedConfig(tp_plan="auto")`) and with
no plan, and compare their greedy frames. Rank 0 writes the outcome as JSON."""

import json
import sys

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

from generation_helpers import prompt
from transformers_drama3 import Drama3ForSpeechGeneration


def greedy(model, seed):
    ids, codes = prompt(seed)
    return model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6,
                          return_dict_in_generate=True).audio_codes


def main(checkpoint: str, output: str) -> None:
    parallel = Drama3ForSpeechGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto", tp_size=2)
    )
    whole = Drama3ForSpeechGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    q_proj = parallel.backbone.layers[3].self_attn.q_proj.weight
    outcome = {
        "q_proj_rows": q_proj.shape[0],
        "q_proj_local_rows": q_proj.to_local().shape[0],
        "equal_frames": [torch.equal(greedy(parallel, seed), greedy(whole, seed)) for seed in (0, 1)],
    }
    if dist.get_rank() == 0:
        with open(output, "w") as handle:
            json.dump(outcome, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
