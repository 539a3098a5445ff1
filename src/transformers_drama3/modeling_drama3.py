"""Drama 3: a Qwen3.5-MoE backbone that predicts the semantic code of each audio frame, and the
Codebook-MTP tower that predicts its 9 acoustic codes.

A position is a row `[main_id, c0 .. c9]`: text rows carry a token and zero codes, audio rows carry
`<|semantic:c0|>` and the frame's codes. The backbone is transformers' `Qwen3_5MoeTextModel`,
composed; only its input (partial codebook fusion) and the tower are new. Module names follow the
published checkpoint, so its tensors load under their own names.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Unpack
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
)
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextModel,
    load_balancing_loss_func,
)
from transformers.utils import ModelOutput, TransformersKwargs
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple, is_flash_attention_requested

from .checkpoint.folder_checks import check_dtype, check_weight_files
from .configuration_drama3 import Drama3AudioDecoderConfig, Drama3Config
from .decoding.request import drama3_generation_config
from .decoding.state import DecodeCache
from .generation_drama3 import Drama3GenerationMixin
from .generation.live_text import Drama3TextStreamingMixin
from .checkpoint.loaded_checkpoint import LoadedCheckpoint, record_files, record_state_dict
# The label of an unsupervised row: defined once, by the rows that carry it.
from .prompting import IGNORE_INDEX
from .checkpoint.quantization import dequantize_state_dict, fuse_expert_weights
from .checkpoint.quantization import experts as routed_experts, quantized_loading
from .integrations import (
    PreTrainedModelWithComposedAttention,
    PreTrainedModelWithComposedExperts,
    PreTrainedModelWithLoadedFiles,
)
from .kernels import fused_step
from .checkpoint.saving import save_model
from .layers.rope import apply_interleaved_rope, rope_cos_sin


# ----------------------------------------------------------------------------- outputs


@dataclass
class Drama3Output(ModelOutput):
    """Output of `Drama3ForSpeechGeneration.forward`. The fields transformers defines mean what they
    mean on any transformers model (`loss`, `aux_loss`, `logits`, `cache`, `hidden_states`,
    `attentions`, `router_logits`); the speech-specific ones have their own names.

    Args:
        loss: `text_loss + 0.5 semantic_loss + 0.5 codebook_loss (+ router aux loss)`.
        aux_loss: the router's load-balancing loss (with labels and router logits).
        logits: `[batch, rows, vocab]`, or `[batch, rows, codebook_size + 1]` when restricted to the
            semantic band (indices 0..4095 = `<|semantic:0..4095|>`) followed by eos (last index).
        codebook_logits: `[batch, rows, num_codebooks - 1, codebook_size]`; row t predicts codes
            1..9 of row t+1 (teacher forcing). None when the tower is not run: a forward with
            labels when `config.codebook_loss_weight` is 0, a forward from `inputs_embeds` alone,
            and a forward that continues a `cache` (the tower's states of earlier rows are not in it).
        cache: with `use_cache=True`, the backbone's cache (transformers' `DynamicCache`: the
            full-attention layers' keys and values, the Gated DeltaNet layers' states) after these
            rows; `past_key_values` is its older name.
        hidden_states: with `output_hidden_states=True`, the backbone's hidden states: the input
            rows' embeddings, then one `[batch, rows, hidden]` per layer (the last after the final norm).
        attentions: with `output_attentions=True` (and the eager attention implementation), the
            attention weights `[batch, heads, rows, keys]` of each full-attention layer of the backbone.
        router_logits: `[batch * rows, num_experts]` per MoE layer, with `output_router_logits`.
        last_hidden_state: `[batch, rows, hidden]` backbone output after its final norm (the input of
            the LM head and of the tower).
        text_loss, semantic_loss, codebook_loss: the loss terms (with labels).
    """

    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    codebook_logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    last_hidden_state: torch.Tensor | None = None
    text_loss: torch.Tensor | None = None
    semantic_loss: torch.Tensor | None = None
    codebook_loss: torch.Tensor | None = None


# ----------------------------------------------------------------------------- tower modules


class Drama3TowerAttention(nn.Module):
    """Gated grouped-query attention; `wqkv` rows are [all queries | all gates | keys | values]."""

    def __init__(self, config: Drama3AudioDecoderConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.n_head, self.n_kv, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        self.rotary_dim, self.rope_base = config.rotary_dim, config.rope_base
        q_width, kv_width = self.n_head * self.head_dim, self.n_kv * self.head_dim
        self.split_sizes = (q_width, q_width, kv_width, kv_width)
        self.wqkv = nn.Linear(config.dim, 2 * q_width + 2 * kv_width, bias=False)
        self.wo = nn.Linear(q_width, config.dim, bias=False)
        self.q_norm = Qwen3_5MoeRMSNorm(config.head_dim, eps=config.norm_eps)
        self.k_norm = Qwen3_5MoeRMSNorm(config.head_dim, eps=config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        cache: DynamicCache | None,
    ) -> torch.Tensor:
        """x: [batch, rows, dim]; rotary: cos, sin [batch, 1, rows, rotary_dim / 2] of the rows'
        positions (`tower_rotary`); attention_mask: bool [batch, 1, rows, keys] (True = attend)."""
        batch, rows, _ = x.shape
        q, gate, k, v = self.wqkv(x).split(self.split_sizes, dim=-1)
        q = self.q_norm(q.view(batch, rows, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, rows, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.view(batch, rows, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_interleaved_rope(q, *rotary), apply_interleaved_rope(k, *rotary)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_index)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.head_dim**-0.5, enable_gqa=self.n_kv != self.n_head
        )
        out = out.transpose(1, 2).reshape(batch, rows, -1)
        return self.wo(out * torch.sigmoid(gate))


class Drama3TowerFeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: Drama3AudioDecoderConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Drama3TowerBlock(nn.Module):
    """Pre-norm causal transformer block (`transformer_layer` in the checkpoint)."""

    def __init__(self, config: Drama3AudioDecoderConfig, layer_index: int):
        super().__init__()
        self.attention = Drama3TowerAttention(config, layer_index)
        self.feed_forward = Drama3TowerFeedForward(config)
        self.attention_norm = Qwen3_5MoeRMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = Qwen3_5MoeRMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x, rotary, attention_mask, cache):
        x = x + self.attention(self.attention_norm(x), rotary, attention_mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Drama3TowerLayer(GradientCheckpointingLayer):
    """One tower layer: `u = eh_proj([enorm(e); hnorm(h)])`, a causal block, then a final norm.

    `e` embeds the code this layer injects (zero where the labelled frame is not audio).
    Subclasses only name the embedding as the checkpoint does.
    """

    embedding_name: str

    def __init__(self, config: Drama3AudioDecoderConfig, layer_index: int):
        super().__init__()
        setattr(self, self.embedding_name, nn.Embedding(config.vocab_size, config.dim))
        self.enorm = Qwen3_5MoeRMSNorm(config.dim, eps=config.norm_eps)
        self.hnorm = Qwen3_5MoeRMSNorm(config.dim, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.transformer_layer = Drama3TowerBlock(config, layer_index)
        self.final_layernorm = Qwen3_5MoeRMSNorm(config.dim, eps=config.norm_eps)
        self.codebook_size = config.vocab_size

    @property
    def embedding(self) -> nn.Embedding:
        return getattr(self, self.embedding_name)

    def forward(
        self,
        hidden: torch.Tensor,
        codes: torch.Tensor,
        audio_weight: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        cache: DynamicCache | None,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: [batch, rows, dim]; codes: [batch, rows]; audio_weight: [batch, rows, 1] in
        hidden's dtype, 1 where the labelled frame is audio (`audio_weights`); rotary: the rows'
        (cos, sin) (`tower_rotary`); extra: [batch, rows, dim]."""
        if fused_inference(hidden, self.embedding, self.enorm, self.hnorm):
            injected = fused_step.tower_injection(
                self.embedding.weight, codes, audio_weight, extra, hidden, self.enorm.weight, self.hnorm.weight,
                self.enorm.eps,
            )
        else:
            e = self.embedding(codes.clamp(0, self.codebook_size - 1)) * audio_weight
            if extra is not None:
                e = e + extra
            injected = torch.cat((self.enorm(e), self.hnorm(hidden)), dim=-1)
        return self.final_layernorm(self.transformer_layer(self.eh_proj(injected), rotary, attention_mask, cache))


class Drama3SharedTowerLayer(Drama3TowerLayer):
    embedding_name = "semantic_embedding"


class Drama3CodebookTowerLayer(Drama3TowerLayer):
    embedding_name = "codebook_embedding"


class Drama3SharedTower(nn.Module):
    """`audio_decoder_mtp_shared`: the layers that inject the frame's semantic code."""

    def __init__(self, config: Drama3AudioDecoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            Drama3SharedTowerLayer(config, i) for i in range(config.shared_enrichment_layers)
        )


class Drama3CodebookTower(nn.Module):
    """`audio_decoder_mtp`: layer i injects code i of the frame; head i predicts code i + 1."""

    def __init__(self, config: Drama3AudioDecoderConfig):
        super().__init__()
        first = config.shared_enrichment_layers
        self.layers = nn.ModuleList(
            Drama3CodebookTowerLayer(config, first + i) for i in range(config.num_codebooks - 1)
        )
        self.heads = nn.ModuleList(
            nn.Linear(config.dim, config.vocab_size, bias=False) for _ in range(config.num_codebooks - 1)
        )


class Drama3CodebookEmbeddings(nn.Module):
    """`audio_decoder`: one table for all codebooks; codebook k uses rows k * codebook_size ..."""

    def __init__(self, config: Drama3AudioDecoderConfig):
        super().__init__()
        self.codebook_size = config.vocab_size
        self.codebook_embeddings = nn.Embedding(config.num_codebooks * config.vocab_size, config.dim)

    def sum_codebooks(self, codes: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Sum of the embeddings of codebooks first..end-1. codes: [batch, rows, num_codebooks]."""
        if end <= first:
            return codes.new_zeros(()).float()
        offsets = torch.arange(first, end, device=codes.device) * self.codebook_size
        rows = codes[..., first:end].clamp(0, self.codebook_size - 1) + offsets
        return self.codebook_embeddings(rows).sum(dim=-2)


# ----------------------------------------------------------------------------- masks and positions


def fused_inference(tensor: torch.Tensor, *modules: nn.Module) -> bool:
    """Whether a fused kernel (`kernels.fused_step`) computes what `modules` would for `tensor`:
    on CUDA, without autograd (the kernels have no backward), and only for the plain modules they
    restate (a PEFT-wrapped or replaced module runs its own forward)."""
    plain = (nn.Embedding, Qwen3_5MoeRMSNorm)
    return fused_step.use_kernel(tensor) and not torch.is_grad_enabled() and all(type(m) in plain for m in modules)


def audio_weights(is_audio: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [batch, rows] -> [batch, rows, 1] in `dtype`: the factor of each row's code embedding
    in the tower (0 where the labelled frame is not audio), cast once for all its layers."""
    return is_audio[..., None].to(dtype)


def positions_from_mask(attention_mask: torch.Tensor, past_length: int = 0) -> torch.Tensor:
    """Row positions that skip left padding: [batch, rows] from a [batch, past + rows] mask."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, past_length:]


def tower_attention_mask(attention_mask: torch.Tensor, rows: int) -> torch.Tensor:
    """Causal mask over the keys of a [batch, keys] padding mask, for the last `rows` queries.

    Returns bool [batch, 1, rows, keys]. A padding query may attend to itself so that softmax
    never sees an empty row (its output is never used).
    """
    keys = attention_mask.shape[-1]
    query_index = torch.arange(keys - rows, keys, device=attention_mask.device)[:, None]
    key_index = torch.arange(keys, device=attention_mask.device)[None, :]
    causal = key_index <= query_index
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    allowed = allowed | (key_index == query_index)[None]
    return allowed[:, None]


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [batch, rows]: True where a row begins a new document (or a padding run), and on each
    row's first position. document_ids: [batch, rows], 1.. per document, 0 on padding."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each row's position inside its own document: long [batch, rows] (0 on padding)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    first = torch.where(document_starts(document_ids), index, torch.zeros_like(index)).cummax(dim=1).values
    return (index - first) * (document_ids != 0)


def document_offsets(document_ids: torch.Tensor) -> torch.Tensor:
    """Where each document (and each padding run) starts in the batch flattened to one sequence,
    plus the total: long [segments + 1], the `cu_seqlens` of varlen kernels. Every row starts a
    segment, so no segment crosses from one row into the next."""
    starts = document_starts(document_ids).flatten().nonzero().squeeze(-1)
    return torch.cat((starts, starts.new_tensor([document_ids.numel()])))


def same_document(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [batch, 1, rows, rows]: query row and key row belong to the same document."""
    return (document_ids[:, :, None] == document_ids[:, None, :])[:, None]


def packed_document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids [batch, rows] (1.. per document) of a padding-free batch: a document starts
    wherever the positions [batch, rows] do not continue by one (transformers' packed-sequence rule,
    `find_packed_sequence_indices`); None when every row holds a single document."""
    documents = find_packed_sequence_indices(position_ids)
    return None if documents is None else documents + 1


def check_forward_inputs(
    config, input_ids, audio_codes, labels, row_weights, attention_mask, inputs_embeds=None, past: int = 0
) -> None:
    """`forward`'s inputs, refused by name before any work: shapes that do not match the rows
    [batch, rows] (torch would fail inside a mask with a bare IndexError), ids outside the text
    vocabulary and codes outside the codebook (an embedding's "index out of range in self")."""
    if input_ids is not None and (input_ids.dim() != 2 or input_ids.is_floating_point()):
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}; "
                         "expected integer ids [batch, rows]")
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size):
        raise ValueError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; expected [batch, rows, hidden] with "
                         f"hidden = {config.hidden_size}")
    rows_shape = tuple((input_ids if input_ids is not None else inputs_embeds).shape[:2])
    if input_ids is not None and inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != rows_shape:
        raise ValueError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; expected [batch, rows, hidden] with "
                         f"[batch, rows] = {rows_shape}, the shape of input_ids")
    for name, value in (("labels", labels), ("row_weights", row_weights)):
        if value is not None and tuple(value.shape) != rows_shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}; expected [batch, rows] = {rows_shape}, "
                             "the shape of input_ids")
    mask_shape = (rows_shape[0], past + rows_shape[1])
    if attention_mask is not None and tuple(attention_mask.shape) != mask_shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected [batch, past + rows] = "
                         f"{mask_shape}. A 4-D mask is not taken: the Gated DeltaNet layers are recurrent and cannot "
                         "follow one; pack documents with document_ids or restarting position_ids instead")
    if audio_codes is not None and tuple(audio_codes.shape) != (*rows_shape, config.num_codebooks):
        raise ValueError(f"audio_codes has shape {tuple(audio_codes.shape)}; expected [batch, rows, num_codebooks] = "
                         f"{(*rows_shape, config.num_codebooks)}")
    vocabulary = config.text_config.vocab_size
    checks = [] if input_ids is None else [("input_ids", input_ids, vocabulary, "the text vocabulary")]
    if audio_codes is not None:
        checks.append(("audio_codes", audio_codes, config.codebook_size, "the codebook size"))
    if labels is not None:
        checks.append(("labels", labels[labels != -100], vocabulary, "the text vocabulary, or -100 for an unsupervised row"))
    for name, values, size, what in checks:
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= size):
            raise ValueError(f"{name} holds values in [{int(values.min())}, {int(values.max())}]; "
                             f"expected [0, {size}) ({what})")


def check_forward_options(labels, document_ids, input_ids, past: int) -> None:
    """Combinations `forward` cannot honour, refused by name: a loss needs the rows' ids (the next
    row is each row's target) and whole rows, and packed documents start with the batch."""
    if labels is not None and input_ids is None:
        raise ValueError("labels need input_ids: each row is trained to predict the next row's ids and codes; "
                         "inputs_embeds alone do not say which rows are audio")
    if labels is not None and past:
        raise ValueError(f"labels need whole rows; the cache already holds {past} rows. Train without a cache")
    if document_ids is not None and past:
        raise ValueError(f"document_ids pack whole rows; the cache already holds {past} rows")


# ----------------------------------------------------------------------------- the model


class Drama3TextModel(
    PreTrainedModelWithComposedAttention, PreTrainedModelWithComposedExperts, Qwen3_5MoeTextModel
):
    """The backbone: transformers' `Qwen3_5MoeTextModel`, unchanged, with the attention
    implementations its full-attention layers take declared as they are: besides eager, sdpa and
    flash-attention (which transformers declares for it), flex_attention and any function
    registered in transformers' attention interface, which those layers reach through
    `ALL_ATTENTION_FUNCTIONS` like every other implementation (flex is tested against eager and sdpa
    in tests/test_attention_backends.py). Its Gated DeltaNet layers take no attention function.

    Defined outside transformers, it answers the questions transformers otherwise answers by reading
    the source of a model's module, whose answers are those of the Qwen3.5-MoE text model it is:
    its attention and experts implementations can be switched (the two `...Composed...` bases) and
    it is not custom code (`is_custom_code`)."""

    _supports_flex_attn = True
    _supports_attention_backend = True

    @classmethod
    def is_custom_code(cls) -> bool:
        # Its modules and `_init_weights` are transformers' own, so it is initialised and its
        # checkpoint names converted as transformers' Qwen3.5-MoE text model is. As "custom code"
        # transformers would skip the modules without parameters of their own, whose init sets the
        # routers' weights (they would stay zero).
        return False


class Drama3PreTrainedModel(
    PreTrainedModelWithComposedAttention, PreTrainedModelWithComposedExperts, PreTrainedModelWithLoadedFiles
):
    config_class = Drama3Config
    config: Drama3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # Class names, matched exactly (accelerate's device map and FSDP wrap policy compare
    # `type(module).__name__`): the two tower layer classes, not their base class.
    _no_split_modules = ["Qwen3_5MoeDecoderLayer", "Drama3SharedTowerLayer", "Drama3CodebookTowerLayer"]
    # The backbone's (`Drama3TextModel`); the tower's attention runs torch's SDPA whatever is chosen.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _is_stateful = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, after refusing a misspelt `dtype` and, for a local
        folder, an incomplete weight file (each named, with what to do)."""
        check_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")))
        if isinstance(pretrained_model_name_or_path, (str, os.PathLike)) and os.path.isdir(pretrained_model_name_or_path):
            check_weight_files(pretrained_model_name_or_path)
        quantization_config = kwargs.get("quantization_config")
        if not args and quantized_loading.weight_quantizer(quantization_config) is not None:
            # torchao / bitsandbytes: routed experts per expert, so that the quantiser reaches them
            # (checkpoint/quantization/quantized_loading.py).
            kwargs.pop("quantization_config")
            return quantized_loading.from_pretrained_quantized(
                cls, super().from_pretrained, pretrained_model_name_or_path, quantization_config, kwargs
            )
        if quantization_config is None and quantized_loading.saved_weight_quantizer(pretrained_model_name_or_path):
            return quantized_loading.from_pretrained_prequantized(super().from_pretrained, pretrained_model_name_or_path, args, kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        return quantized_loading.load_pretrained_weights(
            PreTrainedModelWithLoadedFiles._load_pretrained_model, PreTrainedModel._load_pretrained_model,
            model, state_dict, checkpoint_files, load_config, *args, **kwargs,
        )

    def _init_weights(self, module):
        # The tower is built from the same kinds of modules as the backbone (linears, embeddings,
        # zero-centred norms), so the backbone's initialisation covers both.
        self.backbone._init_weights(module)

    @property
    def backbone(self) -> Drama3TextModel:
        return self.base_model.language_model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.backbone.embed_tokens = value


class Drama3Model(Drama3PreTrainedModel):
    """The base model: the backbone under the checkpoint's `model.language_model` prefix, as
    `model.base_model` of `Drama3ForSpeechGeneration` and `Drama3ForRewardModeling`.

    Its forward is the backbone's over embedded rows. Text rows embed by `input_ids` alone; an audio
    row also sums its acoustic codes (partial codebook fusion), whose table the published layout
    keeps beside `model` in the heads (`audio_decoder`): pass `inputs_embeds=head.embed_rows(input_ids,
    audio_codes)` for rows that hold audio.
    """

    def __init__(self, config: Drama3Config):
        super().__init__(config)
        self.language_model = Drama3TextModel(config.text_config)
        self.post_init()
        # The embedding stays whole under tensor parallelism (`tp_plan="auto"`): the fused decode
        # kernels read its table, so the vocabulary sharding transformers adds for it is dropped.
        self._tp_plan.pop("language_model.embed_tokens", None)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        """The backbone's forward (`Qwen3_5MoeTextModel.forward`): input_ids [batch, rows] or
        inputs_embeds [batch, rows, hidden]; attention_mask [batch, past + rows], or the dict of
        per-layer-type masks the backbone takes; `output_hidden_states`, `output_attentions`,
        `output_router_logits` and `return_dict` as on any transformers model."""
        return self.language_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )


class Drama3ForSpeechGeneration(Drama3PreTrainedModel, Drama3GenerationMixin, Drama3TextStreamingMixin):
    """Drama 3 with its speech heads: lm_head for text and semantic tokens, the Codebook-MTP tower for
    the acoustic codes.

    Module names match the published checkpoint:
    `model.language_model.*` (backbone), `lm_head`, `audio_decoder.codebook_embeddings`,
    `audio_decoder_mtp_shared.layers.N.*`, `audio_decoder_mtp.layers.N.*`, `audio_decoder_mtp.heads.N`.
    """

    _keys_to_ignore_on_load_unexpected = [r"^mtp\."]

    def __init__(self, config: Drama3Config):
        super().__init__(config)
        tower = config.audio_decoder_config
        self.model = Drama3Model(config)
        if routed_experts.routed_experts_split_requested():
            routed_experts.split_routed_experts(self.model.language_model)
        self.lm_head = nn.Linear(config.hidden_size, config.text_config.vocab_size, bias=False)
        self.audio_decoder = Drama3CodebookEmbeddings(tower)
        self.audio_decoder_mtp_shared = Drama3SharedTower(tower)
        self.audio_decoder_mtp = Drama3CodebookTower(tower)
        self.backbone_codebooks = tower.vq_backbone_codebooks
        self.num_codebooks = tower.num_codebooks
        self.post_init()
        # The published serving defaults, so pipelines and saved checkpoints carry them.
        self.generation_config = drama3_generation_config(config)
        # What the weights were loaded from, so that `save_pretrained` writes it back unchanged
        # (`checkpoint/loaded_checkpoint.py`); None for a model built from a config. Set it to None to free
        # the kept FP8 experts (a later save then re-quantises every expert).
        self.loaded_checkpoint: LoadedCheckpoint | None = None
        self.register_load_state_dict_pre_hook(_published_layout_to_modules)

    def loaded_from_files(self, files: list[str]) -> None:
        """Record what `from_pretrained` loaded (safetensors files only), for `save_pretrained`."""
        if all(file.endswith(".safetensors") for file in files):
            self.loaded_checkpoint = record_files(files, self.state_dict(), self._keys_to_ignore_on_load_unexpected or ())

    def save_pretrained(
        self,
        save_directory,
        is_main_process: bool = True,
        state_dict=None,
        push_to_hub: bool = False,
        max_shard_size: int | str = "50GB",
        variant: str | None = None,
        token=None,
        save_peft_format: bool = True,
        save_original_format: bool = True,
        **kwargs,
    ):
        """Save in the published layout (`checkpoint/saving.py`): per-expert tensor names, each
        tensor in the dtype it was loaded in (float32 `A_log`), and, when the config says
        "bsgemm-moe", the routed experts in block-FP8 with their `weight_scale_inv`. A tensor
        unchanged since loading is written byte for byte as loaded, into the same shard files when
        the checkpoint was sharded and each shard fits `max_shard_size`; a changed routed expert is
        re-quantised.

        Returns the names of the routed expert weights quantised from the model's weights (changed
        since loading; all of them for a model not loaded from block-FP8 experts).

        Set `model.config.published_quantization_config = None` to save dense experts instead.
        Adapter-only saves (PEFT), `variant`, `save_original_format=False` and distributed
        checkpoints, models sharded by transformers' `distributed_config` and models offloaded by a
        device map go through transformers' writer, with the experts quantised afresh.
        """
        return save_model(
            self, save_directory, super().save_pretrained, is_main_process=is_main_process, state_dict=state_dict,
            push_to_hub=push_to_hub, max_shard_size=max_shard_size, variant=variant, token=token,
            save_peft_format=save_peft_format, save_original_format=save_original_format, **kwargs,
        )

    # -- small helpers used by generation and training ----------------------------------------

    @property
    def tower_layers(self) -> list[Drama3TowerLayer]:
        return [*self.audio_decoder_mtp_shared.layers, *self.audio_decoder_mtp.layers]

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def is_semantic(self, token_ids: torch.Tensor) -> torch.Tensor:
        return (token_ids >= self.config.semantic_start_token_id) & (
            token_ids <= self.config.semantic_end_token_id
        )

    def speech_token_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """The ids a frame may be: the semantic band, then eos (restricted-logit order)."""
        self.config.check_speech_ids()
        band = torch.arange(
            self.config.semantic_start_token_id, self.config.semantic_end_token_id + 1, device=device
        )
        return torch.cat((band, torch.tensor([self.config.eos_token_id], device=device)))

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head restricted to the semantic band + eos: reads only those rows of the head.

        hidden: [..., dim] -> [..., codebook_size + 1] (last index = eos). The band is one
        contiguous block of rows, so it is read through a view of the weight: gathering its rows
        (`lm_head.weight[speech_token_ids()]`) would copy 4096 x hidden weights on every frame, and
        a copy kept between calls would go stale when the weights change (loading, a LoRA merge,
        an optimiser step); a view never does.
        """
        self.config.check_speech_ids()  # Python ints: nothing a compiled step would break on
        weight = self.lm_head.weight
        start, end, eos = self.config.semantic_start_token_id, self.config.semantic_end_token_id, self.config.eos_token_id
        band = F.linear(hidden, weight[start : end + 1])
        return torch.cat((band, F.linear(hidden, weight[eos : eos + 1])), dim=-1)

    def embed_rows(self, input_ids: torch.Tensor, audio_codes: torch.Tensor | None) -> torch.Tensor:
        """Partial codebook fusion: backbone input for rows [batch, rows].

        Audio rows: `(E_text[main] + sum_{k=1..K} E_cb[k][c_k]) / sqrt(1 + K)`; text rows: `E_text[main]`.
        """
        text_table, codebook_table = self.backbone.embed_tokens, self.audio_decoder.codebook_embeddings
        if audio_codes is not None and self.backbone_codebooks and fused_inference(input_ids, text_table, codebook_table):
            return fused_step.partial_codebook_fusion(
                text_table.weight, codebook_table.weight, input_ids, audio_codes[..., 1 : 1 + self.backbone_codebooks],
                self.config.semantic_start_token_id, self.config.semantic_end_token_id, self.audio_decoder.codebook_size,
            )
        text = text_table(input_ids)
        if audio_codes is None or self.backbone_codebooks == 0:
            return text
        acoustic = self.audio_decoder.sum_codebooks(audio_codes, 1, 1 + self.backbone_codebooks)
        fused = (text + acoustic.to(text.dtype)) * (1 + self.backbone_codebooks) ** -0.5
        return torch.where(self.is_semantic(input_ids)[..., None], fused, text)

    def unseen_codebooks(self, input_ids: torch.Tensor, audio_codes: torch.Tensor) -> torch.Tensor:
        """Codebooks K+1..9 of the input frame (zero on text rows): the first shared layer's extra input."""
        extra = self.audio_decoder.sum_codebooks(audio_codes, 1 + self.backbone_codebooks, self.num_codebooks)
        return extra * self.is_semantic(input_ids)[..., None]

    # -- the tower ------------------------------------------------------------------------------

    def tower_rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [batch, 1, rows, rotary_dim / 2] of row `positions` [batch, rows]: every tower
        layer rotates by the same angles, so a step computes them once, not once per layer."""
        tower = self.config.audio_decoder_config
        return rope_cos_sin(positions[:, None], tower.rotary_dim, tower.rope_base)

    def run_tower(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        audio_codes: torch.Tensor,
        label_codes: torch.Tensor,
        label_is_audio: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None = None,
        heads: bool = True,
    ) -> torch.Tensor | None:
        """Teacher-forced tower: codebook logits for the frames `label_codes`.

        hidden: [batch, rows, dim] backbone output; input_ids, audio_codes: the input rows;
        label_codes: [batch, rows, num_codebooks] the frame each row predicts (the next row);
        label_is_audio: [batch, rows]; attention_mask: bool [batch, 1, rows, keys].
        Returns [batch, rows, num_codebooks - 1, codebook_size]; with `heads=False` the layers only
        (what a prefill needs: their cache), no codebook head runs and None is returned.
        """
        extra = self.unseen_codebooks(input_ids, audio_codes).to(hidden.dtype)
        audio_weight, rotary = audio_weights(label_is_audio, hidden.dtype), self.tower_rotary(positions)
        for index, layer in enumerate(self.audio_decoder_mtp_shared.layers):
            hidden = layer(
                hidden, label_codes[..., 0], audio_weight, rotary, attention_mask, cache,
                extra if index == 0 else None,
            )
        logits = []
        for index, (layer, head) in enumerate(zip(self.audio_decoder_mtp.layers, self.audio_decoder_mtp.heads)):
            hidden = layer(hidden, label_codes[..., index], audio_weight, rotary, attention_mask, cache)
            if heads:
                logits.append(head(hidden))
        return torch.stack(logits, dim=2) if heads else None

    def sample_acoustic_codes(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        audio_codes: torch.Tensor,
        semantic_code: torch.Tensor,
        is_audio: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
        sample,
    ) -> torch.Tensor:
        """One decode step of the tower: codes 1..9 of the next frame, each drawn before the next layer.

        hidden: [batch, 1, dim] backbone output of the current row; input_ids [batch, 1] and
        audio_codes [batch, 1, num_codebooks] the current row; semantic_code [batch, 1] the sampled
        code 0 of the next frame; `sample(logits [batch, 1, codebook_size], codebook) -> [batch, 1]`.
        Returns codes [batch, 1, num_codebooks] of the next frame.
        """
        extra = self.unseen_codebooks(input_ids, audio_codes).to(hidden.dtype)
        audio_weight, rotary = audio_weights(is_audio, hidden.dtype), self.tower_rotary(positions)
        for index, layer in enumerate(self.audio_decoder_mtp_shared.layers):
            hidden = layer(
                hidden, semantic_code, audio_weight, rotary, attention_mask, cache, extra if index == 0 else None
            )
        codes = [semantic_code]
        for index, (layer, head) in enumerate(zip(self.audio_decoder_mtp.layers, self.audio_decoder_mtp.heads)):
            hidden = layer(hidden, codes[-1], audio_weight, rotary, attention_mask, cache)
            codes.append(sample(head(hidden), index + 1))
        return torch.stack(codes, dim=-1)

    # -- incremental evaluation (generation) ----------------------------------------------------

    def prefill(
        self,
        input_ids: torch.Tensor,
        audio_codes: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DecodeCache,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fill `cache` with a prompt of at least 2 rows and return the backbone output [batch, rows, dim].

        The tower is teacher-forced over every row but the last, whose next frame is not known yet:
        the first decode step (`decoding.step.draw`) computes it. Only the tower's layers run (their
        cache is what decoding reads); its codebook heads do not (their logits would be discarded:
        9 x 4096 values a row). `inputs_embeds` [batch, rows, dim]:
        the backbone's input instead of the rows' embeddings (`embed_rows`).
        """
        rows = input_ids.shape[1]
        if rows < 2:
            raise ValueError(f"a prompt needs at least 2 rows; got input_ids of shape {tuple(input_ids.shape)}")
        positions = positions_from_mask(attention_mask)
        hidden = self._cached_backbone(input_ids, audio_codes, attention_mask, positions, cache, inputs_embeds)
        known = attention_mask[:, :-1]
        self.run_tower(
            hidden[:, :-1], input_ids[:, :-1], audio_codes[:, :-1], audio_codes[:, 1:],
            self.is_semantic(input_ids[:, 1:]) & attention_mask[:, 1:].bool(),
            positions[:, :-1], tower_attention_mask(known, rows - 1), cache.tower, heads=False,
        )
        return hidden

    def extend(
        self,
        open_hidden: torch.Tensor,
        open_ids: torch.Tensor,
        open_codes: torch.Tensor,
        input_ids: torch.Tensor,
        audio_codes: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DecodeCache,
    ) -> torch.Tensor:
        """Append rows to a filled cache and return their backbone output [batch, new, dim].

        A filled cache ends with an *open row*: the last row fed, which the tower has not seen yet
        because the row after it was not known (what `prefill` and the decode step's `feed` leave). open_hidden
        [batch, 1, dim] is its backbone output, open_ids [batch, 1] / open_codes [batch, 1,
        num_codebooks] the row itself. input_ids [batch, new] / audio_codes [batch, new,
        num_codebooks] are the new rows; attention_mask [batch, past + new] covers all of them.

        The backbone runs over the new rows from the cache (the Gated DeltaNet layers continue from
        their conv and recurrent states, attention from the cached keys); the tower is teacher-forced
        over the open row and every new row but the last, each labelled with the row after it. The
        cache is then what `prefill` of all the rows leaves, up to float rounding, and the last new
        row is the open row.
        """
        new = input_ids.shape[1]
        past = attention_mask.shape[1] - new
        positions = positions_from_mask(attention_mask)
        hidden = self._cached_backbone(input_ids, audio_codes, attention_mask, positions[:, past:], cache)
        self.run_tower(
            torch.cat((open_hidden, hidden[:, :-1]), dim=1),
            torch.cat((open_ids, input_ids[:, :-1]), dim=1),
            torch.cat((open_codes, audio_codes[:, :-1]), dim=1),
            audio_codes,
            self.is_semantic(input_ids) & attention_mask[:, past:].bool(),
            positions[:, past - 1 : -1],
            tower_attention_mask(attention_mask[:, :-1], new),
            cache.tower,
            heads=False,
        )
        return hidden

    def _cached_backbone(self, input_ids, audio_codes, attention_mask, positions, cache: DecodeCache,
                         inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The backbone over new rows (or `inputs_embeds`, given for them), reading and extending `cache.backbone`."""
        return self.backbone(
            inputs_embeds=self.embed_rows(input_ids, audio_codes) if inputs_embeds is None else inputs_embeds,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache.backbone,
            use_cache=True,
        ).last_hidden_state

    # -- forward ---------------------------------------------------------------------------------

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        audio_codes: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        row_weights: torch.Tensor | None = None,
        restrict_logits: bool = False,
        output_router_logits: bool | None = None,
        position_ids: torch.LongTensor | None = None,
        document_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Drama3Output:
        """Teacher-forced forward over whole rows.

        Args:
            input_ids: [batch, rows]; audio rows carry `<|semantic:c0|>`.
            audio_codes: [batch, rows, num_codebooks]; zeros on text rows.
            attention_mask: [batch, past + rows], 1 for real rows (left padding allowed); defaults to
                `document_ids != 0` for packed rows. A 4-D mask is refused: the Gated DeltaNet layers
                are recurrent and cannot follow one (packed rows: `document_ids` or `position_ids`).
            labels: [batch, rows], aligned with the input rows: `labels[t]` is `input_ids[t]` where
                row t is supervised, -100 elsewhere. Row t is trained to predict row t + 1.
            row_weights: [batch, rows], aligned with `labels`: the weight of supervising each row
                (e.g. the up-weighted seams of an infilling take). Each loss term becomes a weighted
                mean over its rows; None means every weight is 1.
            restrict_logits: return logits over the semantic band + eos only.
            output_router_logits: return the routers' logits (and, with labels, add their
                load-balancing loss); default `config.text_config.output_router_logits`.
            position_ids: [batch, rows]; default: counted from the first real row, or from each
                document's first row for packed rows. Without an attention mask, positions that
                restart (transformers' padding-free batches, `DataCollatorWithFlattening`) mark
                packed documents, as `document_ids` would.
            document_ids: [batch, rows] for packed rows (`PackingCollator`): 1.. per document, 0 on
                padding. Each document then sees only itself, as if it ran alone: the backbone's
                attention layers and the tower get a block-diagonal causal mask, its Gated DeltaNet
                layers (convolution and recurrent state) restart at each document, positions
                restart, and no row is trained to predict the next document's first row.
            cache: the backbone's cache of earlier rows (a `DynamicCache` a forward with
                `use_cache=True` returned; `past_key_values` is its older name). The backbone
                continues from it; the tower does not (its own states are not in it), so
                `codebook_logits` is None.
            inputs_embeds: [batch, rows, hidden], the backbone's input rows in place of
                `embed_rows(input_ids, audio_codes)`. Without `input_ids` the rows' kinds are not
                known, so only `logits` are computed (no tower, no labels).
            use_cache: return the backbone's cache after these rows (`Drama3Output.cache`).
            output_hidden_states, output_attentions, return_dict: as on any transformers model.
        """
        if input_ids is None and inputs_embeds is None:
            raise ValueError("forward needs input_ids [batch, rows] or inputs_embeds [batch, rows, hidden]")
        # An int: transformers returns the cache's own length counter, which the forward advances.
        past = 0 if cache is None else int(cache.get_seq_length())
        if not torch.compiler.is_compiling():  # reading values syncs a device: eager calls only
            check_forward_inputs(
                self.config, input_ids, audio_codes, labels, row_weights, attention_mask, inputs_embeds, past
            )
            check_forward_options(labels, document_ids, input_ids, past)
        batch, rows = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if document_ids is None and attention_mask is None and position_ids is not None and past == 0:
            document_ids = packed_document_ids(position_ids)
        if input_ids is not None and audio_codes is None:
            audio_codes = input_ids.new_zeros(batch, rows, self.num_codebooks)
        if attention_mask is None and document_ids is not None:
            attention_mask = (document_ids != 0).long()
        elif attention_mask is None:
            device = (input_ids if input_ids is not None else inputs_embeds).device
            attention_mask = torch.ones(batch, past + rows, dtype=torch.long, device=device)
        if output_router_logits is None:
            output_router_logits = self.config.text_config.output_router_logits
        if position_ids is None and document_ids is not None:
            position_ids = positions_in_documents(document_ids)
        elif position_ids is None:
            position_ids = positions_from_mask(attention_mask, past)
        if inputs_embeds is None:
            inputs_embeds = self.embed_rows(input_ids, audio_codes)

        rows_mask = attention_mask[:, past:]
        backbone_mask, tower_mask = attention_mask, tower_attention_mask(rows_mask, rows)
        if document_ids is not None:
            backbone_mask = self.document_masks(document_ids, attention_mask, inputs_embeds)
            tower_mask = tower_mask & same_document(document_ids)
            kwargs["cu_seq_lens_q"] = document_offsets(document_ids)
        outputs = self.model(
            inputs_embeds=inputs_embeds,
            attention_mask=backbone_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=bool(use_cache),
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden = outputs.last_hidden_state

        # The tower needs each row's ids and codes and those of the row after it, and its own states
        # of earlier rows; a forward from embeddings alone or from a cache has no codebook logits.
        tower_runs = input_ids is not None and past == 0
        # A training forward whose codebook loss weighs nothing leaves the tower out (a
        # backbone-only stage: the tower is most of a small model's step).
        tower_runs = tower_runs and not (labels is not None and self.config.codebook_loss_weight == 0)
        next_codes = codebook_logits = None
        if input_ids is not None:
            # Row t is labelled with row t + 1 of its own document; the last row gets an empty placeholder frame.
            next_ids = F.pad(input_ids[:, 1:], (0, 1), value=self.config.eos_token_id)
            next_codes = F.pad(audio_codes[:, 1:], (0, 0, 0, 1))
            next_is_real = F.pad(rows_mask[:, 1:].bool(), (0, 1))
            if document_ids is not None:
                next_is_real = next_is_real & ~F.pad(document_starts(document_ids)[:, 1:], (0, 1), value=True)
            next_is_audio = self.is_semantic(next_ids) & next_is_real
        if tower_runs:
            codebook_logits = self.run_tower(
                hidden, input_ids, audio_codes, next_codes, next_is_audio, position_ids, tower_mask,
            )
        logits = self.speech_logits(hidden) if restrict_logits else self.lm_head(hidden)

        output = Drama3Output(
            logits=logits,
            codebook_logits=codebook_logits,
            cache=outputs.cache if use_cache else None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits if output_router_logits else None,
            last_hidden_state=hidden,
        )
        if labels is not None:
            if document_ids is not None:
                # A document's first row is never its own target; this keeps the previous
                # document's last row from being trained to predict it.
                labels = labels.masked_fill(document_starts(document_ids), IGNORE_INDEX)
            self._add_losses(output, labels, row_weights, next_codes, rows_mask, restrict_logits)
        return output

    def document_masks(
        self, document_ids: torch.Tensor, attention_mask: torch.Tensor, inputs_embeds: torch.Tensor
    ) -> dict[str, torch.Tensor | None]:
        """The backbone's masks for packed rows, one per layer type (the form `Qwen3_5MoeTextModel`
        takes): full attention gets a block-diagonal causal mask in the layout its attention
        implementation wants (padding, document 0, sees only padding); the Gated DeltaNet layers
        get the 2-D padding mask (their document boundaries travel as `cu_seq_lens_q`)."""
        config = self.backbone.config
        if is_flash_attention_requested(config):
            raise ValueError(
                f"document_ids need an attention implementation that takes a 4-D mask (sdpa, eager, "
                f"flex_attention); this backbone uses {config._attn_implementation!r}. Unpack the batch "
                "instead (transformers_drama3.training.unpack), or load the model with attn_implementation='sdpa'."
            )
        return {
            "full_attention": create_causal_mask(
                config=config,
                inputs_embeds=inputs_embeds,
                attention_mask=None,
                cache=None,
                and_mask_function=packed_sequence_mask_function(document_ids),
            ),
            "linear_attention": create_recurrent_attention_mask(config, inputs_embeds, attention_mask),
        }

    def _add_losses(self, output, labels, row_weights, next_codes, attention_mask, restricted) -> None:
        """L = L_text + 0.5 L_sem + 0.5 L_cb (+ router load balancing), each averaged over its own rows."""
        if restricted:
            raise ValueError("labels need full-vocabulary logits; call forward with restrict_logits=False")
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [batch, rows]
        weights = None if row_weights is None else F.pad(row_weights[:, 1:].float(), (0, 1))
        supervised = targets != IGNORE_INDEX
        semantic = supervised & self.is_semantic(targets)
        text = supervised & ~semantic
        logits = output.logits.float()
        output.text_loss = _masked_cross_entropy(logits, targets, text, weights)
        output.semantic_loss = _masked_cross_entropy(logits, targets, semantic, weights)
        loss = output.text_loss + self.config.semantic_loss_weight * output.semantic_loss
        if output.codebook_logits is not None:
            acoustic_targets = next_codes[..., 1:]  # [batch, rows, num_codebooks - 1]
            acoustic_mask = semantic[..., None].expand_as(acoustic_targets)
            acoustic_weights = None if weights is None else weights[..., None].expand_as(acoustic_targets)
            output.codebook_loss = _masked_cross_entropy(
                output.codebook_logits.float(), acoustic_targets, acoustic_mask, acoustic_weights
            )
            loss = loss + self.config.codebook_loss_weight * output.codebook_loss
        if output.router_logits is not None:
            text_config = self.config.text_config
            output.aux_loss = load_balancing_loss_func(
                output.router_logits, text_config.num_experts, text_config.num_experts_per_tok, attention_mask
            )
            loss = loss + text_config.router_aux_loss_coef * output.aux_loss
        output.loss = loss


def _published_layout_to_modules(module, state_dict, prefix, *args) -> None:
    """`load_state_dict` pre-hook: accept the published layout (per-expert names, block-FP8 experts)
    as `from_pretrained` does, so that a checkpoint file read directly (Trainer's resume, a user's
    `load_file`) loads into the fused experts. The model records what it was given, as
    `from_pretrained` does, so that a later save writes it back unchanged."""
    if not any(name.endswith("_scale_inv") or ".mlp.experts.0." in name for name in state_dict):
        return
    published = {name.removeprefix(prefix): tensor for name, tensor in state_dict.items() if name.startswith(prefix)}
    module.loaded_checkpoint = record_state_dict(
        published, module.state_dict(), module._keys_to_ignore_on_load_unexpected or ()
    )
    dense, _ = dequantize_state_dict(state_dict, dtype=module.dtype)
    converted = fuse_expert_weights(dense)
    state_dict.clear()
    state_dict.update(converted)


def _masked_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(Weighted) mean cross-entropy over the positions where `mask` is True (0, with a gradient path,
    if there are none)."""
    if not mask.any():
        return logits.sum() * 0.0
    if weights is None:
        return F.cross_entropy(logits[mask], targets[mask])
    losses = F.cross_entropy(logits[mask], targets[mask], reduction="none")
    total = weights[mask].sum()
    if total <= 0:
        return logits.sum() * 0.0
    return (losses * weights[mask]).sum() / total
