"""transformers' common model tests on Drama 3, as transformers runs them on its own models.

`Drama3ModelTester` + a `unittest.TestCase` mixing in transformers' `ModelTesterMixin`, with
`ConfigTester` for the config, for `Drama3ForSpeechGeneration` and `Drama3ForRewardModeling`, on a
2-layer config (one Gated DeltaNet layer, one full-attention layer, 4 routed experts) and rows that
mix text and audio. The mixins come from the installed transformers version's source distribution
(`transformers_common_tests`, fetched by `.ci/run`); without them this module is skipped, naming
how to get them.

Nothing is skipped here: every test transformers' csm and moshi tests skip passes on Drama 3. The
skips in a run are the mixin's own (no CUDA or accelerator, flash-attn not installed, a test for
another kind of model). One test is adapted as transformers adapts it for Qwen3.5-MoE: attention
weights come from the full-attention layers only.
"""

import copy
import unittest
from unittest import mock

import pytest
import torch

import transformers_common_tests as common
from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.modeling_drama3_reward import Drama3ForRewardModeling

if common.missing_reason():
    pytest.skip(common.missing_reason(), allow_module_level=True)

modeling_common = common.load("test_modeling_common")
ConfigTester = common.load("test_configuration_common").ConfigTester
ModelTesterMixin = modeling_common.ModelTesterMixin
ids_tensor = modeling_common.ids_tensor

SEMANTIC_START = 40
CODEBOOK_SIZE = 16
NUM_CODEBOOKS = 4


class Drama3ModelTester:
    """A 2-layer Drama 3 (a Gated DeltaNet layer and a full-attention layer, 4 routed experts) and a
    batch of rows that mixes text rows and audio rows (semantic token + the frame's codes)."""

    def __init__(self, parent, batch_size=4, seq_length=7, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = SEMANTIC_START + CODEBOOK_SIZE + 4
        self.hidden_size = 32
        self.layer_types = ["linear_attention", "full_attention"]
        self.num_hidden_layers = len(self.layer_types)
        self.num_attention_heads = 4
        self.num_codebooks = NUM_CODEBOOKS
        self.eos_token_id = 2
        self.pad_token_id = 0

    def get_config(self) -> Drama3Config:
        text = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": len(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "layer_types": self.layer_types,
            "pad_token_id": self.pad_token_id,
        }
        tower = {
            "dim": self.hidden_size,
            "n_head": 4,
            "n_local_heads": 2,
            "head_dim": 8,
            "n_layer": 1,
            "shared_enrichment_layers": 1,
            "intermediate_size": 32,
            "num_codebooks": self.num_codebooks,
            "vocab_size": CODEBOOK_SIZE,
        }
        return Drama3Config(
            text_config=text,
            audio_decoder_config=tower,
            semantic_start_token_id=SEMANTIC_START,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )

    def prepare_config_and_inputs(self):
        config = self.get_config()
        text_ids = ids_tensor([self.batch_size, self.seq_length], SEMANTIC_START - 3) + 3
        codes = ids_tensor([self.batch_size, self.seq_length, self.num_codebooks], CODEBOOK_SIZE)
        is_audio = ids_tensor([self.batch_size, self.seq_length], 2).bool()
        input_ids = torch.where(is_audio, SEMANTIC_START + codes[..., 0], text_ids)
        audio_codes = codes * is_audio[..., None]
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :2] = 0  # a left-padded row
        return config, input_ids, audio_codes, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, audio_codes, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "audio_codes": audio_codes, "attention_mask": attention_mask}


class Drama3ModelTest(ModelTesterMixin, unittest.TestCase):
    # The heads. transformers' base-model tests recognise a base model by transformers' own model
    # names (MODEL_MAPPING_NAMES), which a model defined outside transformers is not among: they
    # would test Drama3Model as a head (a loss to train on). The heads' tests reach it as
    # `base_model`; tests/test_forward_contract.py checks it as a base model.
    all_model_classes = (Drama3ForSpeechGeneration, Drama3ForRewardModeling)
    # The generation tester is not in transformers' source distribution; tests/test_generation*.py
    # check generate() (as transformers' rule for a model tested without it asks).
    all_generative_model_classes = ()
    # What the tests that pass only the main input (input_ids) pass besides: the frames' codes.
    additional_model_inputs = ["audio_codes"]

    def setUp(self):
        self.model_tester = Drama3ModelTester(self)
        self.config_tester = ConfigTester(self, config_class=Drama3Config, has_text_modality=False)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_attention_outputs(self):
        """The mixin's test, counting the layers that have attention weights: the full-attention
        layers (the Gated DeltaNet layers have none), as transformers' Qwen3.5-MoE test counts them."""
        full_attention_layers = self.model_tester.layer_types.count("full_attention")
        with mock.patch.object(self.model_tester, "num_hidden_layers", full_attention_layers):
            super().test_attention_outputs()

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = copy.deepcopy(inputs_dict)
        if return_labels:
            if model_class is Drama3ForSpeechGeneration:
                padding = inputs_dict["attention_mask"] == 0
                inputs_dict["labels"] = inputs_dict["input_ids"].masked_fill(padding, -100)
            elif model_class is Drama3ForRewardModeling:
                # Bradley-Terry pairs: the first half of the rows against the second.
                inputs_dict["labels"] = torch.ones(self.model_tester.batch_size // 2)
        return inputs_dict
