"""The shipped accelerate configs (examples/accelerate/): what they shard, what they need per GPU,
and what examples/train.py refuses under them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

from training_helpers import stack_model
from transformers_drama3.training.memory_estimate import training_memory

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "accelerate"
FSDP_CONFIGS = ["fsdp2_single_node_8gpu.yaml", "fsdp2_multi_node.yaml"]


@pytest.mark.parametrize("name", FSDP_CONFIGS)
def test_fsdp_configs_wrap_each_decoder_layer_and_each_tower_layer(name):
    launch = load_config_from_file(str(CONFIGS / name))
    assert launch.distributed_type == DistributedType.FSDP and launch.mixed_precision == "bf16"
    fsdp = launch.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_activation_checkpointing"] is True
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
        transformer_cls_names_to_wrap=fsdp["fsdp_transformer_layer_cls_to_wrap"].split(","),
    )
    model = stack_model()
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [module for module in model.modules() if policy(module)]
    assert wrapped == [*model.backbone.layers, *model.tower_layers]
    # the routed experts live inside the wrapped decoder layers: fully_shard splits their stacks too
    assert all(any("mlp.experts" in n for n, _ in layer.named_parameters()) for layer in model.backbone.layers)


def test_zero3_config_is_stage_3_and_saves_16_bit_weights():
    launch = load_config_from_file(str(CONFIGS / "deepspeed_zero3.yaml"))
    assert launch.distributed_type == DistributedType.DEEPSPEED
    ds = launch.deepspeed_config
    plugin = DeepSpeedPlugin(
        zero_stage=ds["zero_stage"], zero3_init_flag=ds["zero3_init_flag"],
        zero3_save_16bit_model=ds["zero3_save_16bit_model"], offload_optimizer_device=ds["offload_optimizer_device"],
        offload_param_device=ds["offload_param_device"], gradient_clipping=ds["gradient_clipping"],
    )
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_the_memory_table_in_the_docs_is_what_the_configs_need():
    """docs/scale_out.md's table is `training_memory` of the shipped configs (cannot go stale)."""
    doc = (ROOT / "docs" / "scale_out.md").read_text()
    for name in [*FSDP_CONFIGS, "deepspeed_zero3.yaml"]:
        for optimizer in ("adamw",) if "deepspeed" in name else ("adamw", "muon"):
            memory = training_memory(str(CONFIGS / name), optimizer=optimizer)
            row = memory.row().replace(str(CONFIGS / name), f"examples/accelerate/{name}")
            assert row in doc, row


def test_more_processes_need_less_memory_each():
    one_node = training_memory(str(CONFIGS / "fsdp2_single_node_8gpu.yaml"))
    two_nodes = training_memory(str(CONFIGS / "fsdp2_multi_node.yaml"))
    assert two_nodes.sharded_state == pytest.approx(one_node.sharded_state / 2)
    assert two_nodes.gathered == one_node.gathered


def test_muon_under_deepspeed_is_refused_before_any_work(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT / "examples"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    output = tmp_path / "out"
    with pytest.raises(SystemExit, match="--optimizer muon cannot run under DeepSpeed ZeRO-3"):
        train.train(train.parse_args(["--model", str(tmp_path / "missing"), "--data", str(tmp_path / "none"),
                                      "--output", str(output), "--optimizer", "muon"]))
    assert not output.exists()
