"""Configuration of Drama 3 in the published `fish_omni` layout.

The published `config.json` has three parts: `text_config` (a Qwen3.5-MoE text config, written with
model_type "fish_omni_text" and a few keys only Fish writes), `audio_decoder_config` (the
Codebook-MTP tower, "fish_qwen3_audio_decoder") and top-level token ids. The defaults here are the
full Drama 3 architecture; how each size that the public material does not state was derived is
written next to it.
"""

from __future__ import annotations

import json
import math
import os

import torch
from transformers import PretrainedConfig, Qwen3_5MoeTextConfig

from .checkpoint.quantization import is_block_fp8_config, transformers_quantization_config

SPEECH_TEMPLATE_VERSION = "reference-bracket-v1"
# Codes per frame: codebook 0 (semantic) and 9 acoustic ones. The one source of this count.
NUM_CODEBOOKS = 10
TEXT_MODEL_TYPES = ("fish_omni_text", "qwen3_5_moe_text")

# Keys Fish writes into text_config that state what the stock Qwen3.5-MoE text model hard-codes.
# They are checked on load (a checkpoint that differs would load but compute something else) and
# written back on save.
FIXED_TEXT_SETTINGS = {
    "attn_output_gate": True,
    "hidden_act": "silu",
    "layernorm_zero_centered_gamma": True,
    "rotary_interleaved": False,
    "shared_expert_gate": True,
    "use_qk_norm": True,
}

# Qwen3.5-35B-A3B's language model. transformers' Qwen3_5MoeTextConfig defaults to these sizes
# except rope_theta, which the released Qwen3.5 models set to 1e7.
QWEN3_5_35B_A3B_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
QWEN3_5_VOCAB_SIZE = 248320
SEMANTIC_CODEBOOK_SIZE = 4096
# Assumed vocabulary: the 4096 semantic tokens appended after Qwen3.5's 248,320 rows (the control
# tokens <|voice|>, <|speaker:N|>, ... fit in Qwen's unused rows). The public material gives no ids;
# a real config.json overrides all three.
DEFAULT_SEMANTIC_START = QWEN3_5_VOCAB_SIZE
DEFAULT_VOCAB_SIZE = QWEN3_5_VOCAB_SIZE + SEMANTIC_CODEBOOK_SIZE
DEFAULT_EOS_TOKEN_ID = 248046  # <|im_end|> in the Qwen3.5 tokenizer


class Drama3TextConfig(Qwen3_5MoeTextConfig):
    """The backbone config: transformers' Qwen3.5-MoE text config under Fish's model_type.

    Only the model_type differs from the parent, so transformers' Qwen3.5-MoE modules, cache and
    masks read it unchanged. Fish-only keys (`mlp_layer_types`, `use_qk_norm`, ...) are kept as
    attributes and written back by `to_dict`.
    """

    model_type = "fish_omni_text"

    def __init__(self, **kwargs):
        for key, value in FIXED_TEXT_SETTINGS.items():
            if kwargs.get(key, value) != value:
                raise ValueError(
                    f"text_config.{key}={kwargs[key]!r} is not supported: the Qwen3.5-MoE backbone "
                    f"hard-codes {value!r}"
                )
            kwargs.setdefault(key, value)
        kwargs.setdefault("rope_parameters", dict(QWEN3_5_35B_A3B_ROPE))
        kwargs.setdefault("vocab_size", DEFAULT_VOCAB_SIZE)
        kwargs.setdefault("max_position_embeddings", 262144)
        # Fish spells an all-MoE stack "moe"; transformers' validator only knows sparse/dense, and
        # the stock Qwen3.5-MoE layer is always sparse, so the key is checked here and re-added
        # by to_dict.
        mlp_layer_types = kwargs.pop("mlp_layer_types", None)
        super().__init__(**kwargs)
        layers = self.num_hidden_layers
        if mlp_layer_types is not None and list(mlp_layer_types) != ["moe"] * layers:
            raise ValueError(
                f"text_config.mlp_layer_types must be 'moe' for each of the {layers} layers; "
                f"got {mlp_layer_types!r}"
            )

    def to_dict(self) -> dict:
        output = super().to_dict()
        output["mlp_layer_types"] = ["moe"] * self.num_hidden_layers
        return output


class Drama3AudioDecoderConfig(PretrainedConfig):
    """The Codebook-MTP tower (`audio_decoder_config`), under the checkpoint's own field names.

    13 layers for the default 10 codebooks: `shared_enrichment_layers` (4) that inject the semantic
    code, then one layer per acoustic codebook 1-9 with a 4096-way head each.

    Sizes the public material does not state, derived from the paper's per-frame table:
    `dim`, `n_head`, `n_local_heads`, `head_dim` equal the backbone's (2048, 16, 2, 256), which the
    serving code requires. A tower layer then holds eh_proj 2*2048*2048 + wqkv 2048*(2*16+2*2)*256
    + wo 4096*2048 = 35.7M parameters besides its SwiGLU; 13 layers plus 9 heads of 4096*2048 are
    0.54B. The paper's ~2.1 GB (bf16) per frame leaves ~0.5B for 13 SwiGLUs of 3*2048*I, so
    I ~ 6300; `intermediate_size` 6144 (Qwen3's 2048-wide FFN) gives 2.06 GB.

    `rotary_interleaved` and `attention_qk_norm` are stored but not read: the published tower always
    uses interleaved (GPT-J pair) RoPE and per-head q/k norms, whatever they say.
    """

    model_type = "fish_qwen3_audio_decoder"
    base_config_key = "audio_decoder_config"

    def __init__(
        self,
        decoder_type: str = "codebook_mtp_shared",
        dim: int = 2048,
        text_dim: int | None = None,
        n_head: int = 16,
        n_local_heads: int = 2,
        head_dim: int = 256,
        n_layer: int | None = None,
        shared_enrichment_layers: int = 4,
        intermediate_size: int = 6144,
        norm_eps: float = 1e-6,
        num_codebooks: int = NUM_CODEBOOKS,
        vocab_size: int = SEMANTIC_CODEBOOK_SIZE,
        max_seq_len: int | None = None,
        rope_base: float = 1e7,
        rotary_percent: float = 0.25,
        rotary_interleaved: bool = True,
        attention_output_gate: bool = True,
        attention_qk_norm: bool = False,
        layernorm_zero_centered_gamma: bool = True,
        vq_feature_scope: str = "all_vq",
        vq_feature_placement: str = "backbone_partial",
        vq_backbone_codebooks: int = 1,
        mtp_spec: dict | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.decoder_type = decoder_type
        self.dim = dim
        self.text_dim = dim if text_dim is None else text_dim
        self.n_head = n_head
        self.n_local_heads = n_local_heads
        self.head_dim = head_dim
        self.shared_enrichment_layers = shared_enrichment_layers
        self.n_layer = shared_enrichment_layers if n_layer is None else n_layer
        self.intermediate_size = intermediate_size
        self.norm_eps = norm_eps
        self.num_codebooks = num_codebooks
        self.vocab_size = vocab_size
        self.max_seq_len = num_codebooks + 1 if max_seq_len is None else max_seq_len
        self.rope_base = rope_base
        self.rotary_percent = rotary_percent
        self.rotary_interleaved = rotary_interleaved
        self.attention_output_gate = attention_output_gate
        self.attention_qk_norm = attention_qk_norm
        self.layernorm_zero_centered_gamma = layernorm_zero_centered_gamma
        self.vq_feature_scope = vq_feature_scope
        self.vq_feature_placement = vq_feature_placement
        self.vq_backbone_codebooks = vq_backbone_codebooks
        self.mtp_spec = dict(mtp_spec or {})
        self.initializer_range = initializer_range
        super().__init__(**kwargs)
        self._validate_tower()

    def _validate_tower(self) -> None:
        if self.decoder_type != "codebook_mtp_shared":
            raise ValueError(
                f"audio_decoder_config.decoder_type={self.decoder_type!r}; only "
                f"'codebook_mtp_shared' (the Drama 3 tower) is supported"
            )
        if self.n_layer != self.shared_enrichment_layers:
            raise ValueError(
                f"audio_decoder_config.n_layer={self.n_layer} must equal "
                f"shared_enrichment_layers={self.shared_enrichment_layers}"
            )
        if not 0 <= self.vq_backbone_codebooks <= self.num_codebooks - 1:
            raise ValueError(
                f"audio_decoder_config.vq_backbone_codebooks={self.vq_backbone_codebooks} must be "
                f"in [0, {self.num_codebooks - 1}]"
            )
        if self.n_head % self.n_local_heads:
            raise ValueError(
                f"audio_decoder_config.n_head={self.n_head} is not a multiple of "
                f"n_local_heads={self.n_local_heads}"
            )
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(
                f"audio_decoder_config: head_dim * rotary_percent = {self.rotary_dim} must be a "
                f"positive even number"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    @property
    def num_tower_layers(self) -> int:
        """Sequential tower layers per frame: the shared layers, then one per acoustic codebook."""
        return self.shared_enrichment_layers + self.num_codebooks - 1


def _check_dtype_field(config: dict, location: str) -> None:
    """Refuse a misspelt dtype in a config's fields (config.json), naming the field: transformers
    would fail later with torch's bare `AttributeError: module 'torch' has no attribute ...`."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str) and value != "auto" and not isinstance(getattr(torch, value, None), torch.dtype):
            raise ValueError(
                f"config {location}{key}={value!r} is not a torch dtype (a typo in config.json?); expected "
                "'float32', 'bfloat16' or 'float16'"
            )


class Drama3Config(PretrainedConfig):
    """Drama 3 (`model_type` "fish_omni"): a Qwen3.5-MoE backbone plus the Codebook-MTP tower.

    Reads and writes the published `config.json`. Besides the published fields it carries the
    codec's `sampling_rate` and `frame_size` (samples per frame), used to turn frames into seconds.

    Args:
        text_config: backbone config (dict or `Drama3TextConfig`); defaults to Qwen3.5-35B-A3B.
        audio_decoder_config: tower config (dict or `Drama3AudioDecoderConfig`).
        semantic_start_token_id / semantic_end_token_id: the band of `<|semantic:0|>` ..
            `<|semantic:4095|>`; it spans exactly the tower's `vocab_size` ids.
        eos_token_id: id of `<|im_end|>`, which ends a take. The band and eos must lie in the text
            vocabulary when the model speaks (`check_speech_ids`); the defaults are Drama 3's ids.
        quantization_config: `{"quant_method": "bsgemm-moe", ...}` when the routed experts are
            block-FP8; `None` for a float checkpoint.
        sampling_rate, frame_size: the codec's rate and samples per frame (not in the published
            file; 44100 and 2048 for the S2 codec).
        semantic_loss_weight, codebook_loss_weight: the paper's 0.5 and 0.5 in
            `L = L_text + 0.5 L_sem + 0.5 L_cb` (not in the published file).
    """

    model_type = "fish_omni"
    sub_configs = {"text_config": Drama3TextConfig, "audio_decoder_config": Drama3AudioDecoderConfig}

    def __init__(
        self,
        text_config: dict | Qwen3_5MoeTextConfig | None = None,
        audio_decoder_config: dict | Drama3AudioDecoderConfig | None = None,
        semantic_start_token_id: int = DEFAULT_SEMANTIC_START,
        semantic_end_token_id: int | None = None,
        eos_token_id: int = DEFAULT_EOS_TOKEN_ID,
        speech_template_version: str = SPEECH_TEMPLATE_VERSION,
        sampling_rate: int = 44100,
        frame_size: int = 2048,
        semantic_loss_weight: float = 0.5,
        codebook_loss_weight: float = 0.5,
        **kwargs,
    ):
        _check_dtype_field(kwargs, "")
        for name, part in (("text_config", text_config), ("audio_decoder_config", audio_decoder_config)):
            if isinstance(part, dict):
                _check_dtype_field(part, f"{name}.")
        # The published "bsgemm-moe" experts are exactly transformers' fine-grained "fp8" format;
        # transformers loads them only under that name (dequantised on CPU, FP8 on CUDA), so the
        # published dict is kept aside and written back by to_dict.
        quantization_config = kwargs.pop("quantization_config", None)
        self.published_quantization_config = None
        if is_block_fp8_config(quantization_config):
            self.published_quantization_config = dict(quantization_config)
            kwargs["quantization_config"] = transformers_quantization_config(quantization_config)
        elif quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        self.text_config = _text_config_from(text_config)
        self.audio_decoder_config = _tower_config_from(audio_decoder_config, self.text_config)
        self.semantic_start_token_id = semantic_start_token_id
        self.semantic_end_token_id = (
            semantic_start_token_id + self.audio_decoder_config.vocab_size - 1
            if semantic_end_token_id is None
            else semantic_end_token_id
        )
        self.speech_template_version = speech_template_version
        self.sampling_rate = sampling_rate
        self.frame_size = frame_size
        self.semantic_loss_weight = semantic_loss_weight
        self.codebook_loss_weight = codebook_loss_weight
        kwargs.setdefault("architectures", ["FishOmniModel"])
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(eos_token_id=eos_token_id, **kwargs)
        self._validate_ids()

    def _validate_ids(self) -> None:
        """What the ids must satisfy whatever the vocabulary: the band spans the codebook and eos lies
        outside it. Whether they fit the text vocabulary is checked where they index it
        (`check_speech_ids`), so that a config builds from its defaults on any vocabulary."""
        band = self.semantic_end_token_id - self.semantic_start_token_id + 1
        if band != self.audio_decoder_config.vocab_size:
            raise ValueError(
                f"the semantic band [{self.semantic_start_token_id}, {self.semantic_end_token_id}] "
                f"holds {band} ids; the codebook size is {self.audio_decoder_config.vocab_size}"
            )
        if self.eos_token_id is not None and self.semantic_start_token_id <= self.eos_token_id <= self.semantic_end_token_id:
            raise ValueError(f"eos_token_id={self.eos_token_id} lies inside the semantic band")
        if self.audio_decoder_config.dim != self.text_config.hidden_size:
            raise ValueError(
                f"audio_decoder_config.dim={self.audio_decoder_config.dim} must equal the "
                f"backbone hidden_size={self.text_config.hidden_size}"
            )
        if self.speech_template_version != SPEECH_TEMPLATE_VERSION:
            raise ValueError(
                f"speech_template_version={self.speech_template_version!r}; this package builds "
                f"{SPEECH_TEMPLATE_VERSION!r} prompts"
            )

    def check_speech_ids(self) -> None:
        """Refuse a semantic band or an eos id outside the text vocabulary, naming them: the speech
        logits read those rows of the LM head, a frame is drawn among them and a take ends on eos.

        Checked where the ids index the vocabulary (`Drama3ForSpeechGeneration.speech_logits`,
        `speech_token_ids`), not when the config is built, because `resize_token_embeddings` and
        configs built from defaults change the vocabulary after the ids are set."""
        vocab = self.text_config.vocab_size
        if self.semantic_start_token_id < 0 or self.semantic_end_token_id >= vocab:
            raise ValueError(
                f"the semantic band [{self.semantic_start_token_id}, {self.semantic_end_token_id}] "
                f"(semantic_start_token_id, semantic_end_token_id) is outside the text vocabulary of {vocab}"
            )
        if self.eos_token_id is None or not 0 <= self.eos_token_id < vocab:
            raise ValueError(f"eos_token_id={self.eos_token_id} is outside the text vocabulary of {vocab}")

    # A config FILE always states its backbone; only code may rely on the full-size default
    # (Drama3Config() on the meta device). A file without text_config would silently build the 35B
    # backbone and fail much later on a size mismatch.
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        _require_text_config(config_dict, f"{os.fspath(pretrained_model_name_or_path)}/config.json")
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        _require_text_config(config_dict, "config")
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_json_file(cls, json_file):
        with open(json_file, encoding="utf-8") as reader:
            try:
                config_dict = json.load(reader)
            except json.JSONDecodeError as error:
                raise ValueError(f"{json_file}: not valid JSON ({error})") from None
        _require_text_config(config_dict, os.fspath(json_file))
        return cls(**config_dict)

    # Names used throughout the package.
    @property
    def num_codebooks(self) -> int:
        return self.audio_decoder_config.num_codebooks

    @property
    def codebook_size(self) -> int:
        return self.audio_decoder_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def initializer_range(self) -> float:
        return self.text_config.initializer_range

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.frame_size

    @property
    def is_block_fp8(self) -> bool:
        """Whether checkpoints of this config store the routed experts as block-FP8."""
        return self.published_quantization_config is not None

    def to_dict(self) -> dict:
        return self._with_published_quantization(super().to_dict())

    def to_diff_dict(self) -> dict:
        return self._with_published_quantization(super().to_diff_dict())

    def _with_published_quantization(self, output: dict) -> dict:
        output.pop("published_quantization_config", None)
        if self.published_quantization_config is not None:
            output["quantization_config"] = dict(self.published_quantization_config)
        return output


def _require_text_config(config_dict, source: str) -> None:
    if not isinstance(config_dict, dict) or config_dict.get("text_config") is None:
        raise ValueError(
            f"{source}: no text_config (the backbone's sizes); a Drama 3 config.json holds them under "
            f"\"text_config\" — the file is incomplete or is not a Drama 3 config"
        )


def _text_config_from(text_config) -> Drama3TextConfig:
    if isinstance(text_config, Drama3TextConfig):
        return text_config
    if isinstance(text_config, Qwen3_5MoeTextConfig):
        return Drama3TextConfig(**{k: v for k, v in text_config.to_dict().items() if k != "model_type"})
    text_config = dict(text_config or {})
    model_type = text_config.pop("model_type", "fish_omni_text")
    if model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"text_config.model_type={model_type!r}; expected one of {TEXT_MODEL_TYPES}")
    for key in ("transformers_version",):
        text_config.pop(key, None)
    return Drama3TextConfig(**text_config)


def _tower_config_from(tower_config, text_config: Drama3TextConfig) -> Drama3AudioDecoderConfig:
    if isinstance(tower_config, Drama3AudioDecoderConfig):
        return tower_config
    tower_config = dict(tower_config or {})
    tower_config.pop("model_type", None)
    tower_config.pop("transformers_version", None)
    if not tower_config:
        # The full-size tower follows the backbone's attention shape (the serving code requires it).
        tower_config = {
            "dim": text_config.hidden_size,
            "n_head": text_config.num_attention_heads,
            "n_local_heads": text_config.num_key_value_heads,
            "head_dim": text_config.head_dim,
            "norm_eps": text_config.rms_norm_eps,
        }
    return Drama3AudioDecoderConfig(**tower_config)


def expected_frames(seconds: float, config: Drama3Config) -> int:
    """Whole frames covering `seconds` of audio at the codec's frame rate."""
    return math.ceil(seconds * config.frame_rate)
