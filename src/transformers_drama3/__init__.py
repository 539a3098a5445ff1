"""Fish Audio Drama 3 for Hugging Face Transformers.

`import transformers_drama3` registers the model and processor with the Auto classes, so that
`AutoModel.from_pretrained(path)` loads a published Drama 3 checkpoint (`model_type` "fish_omni"),
`AutoProcessor` its tokenizer and codec, and `pipeline("text-to-speech", model=path)` speaks.
It also routes the backbone's Gated DeltaNet functions by device (fla for CUDA tensors, PyTorch
otherwise; see `integrations.install_device_dispatch`, and `DRAMA3_DEVICE_DISPATCH=0` to opt out).
"""

from transformers import AutoConfig, AutoModel, AutoModelForTextToWaveform
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)

from . import integrations
from .configuration_drama3 import Drama3AudioDecoderConfig, Drama3Config, Drama3TextConfig
from .modeling_drama3 import Drama3Cache, Drama3ForSpeechGeneration, Drama3Output
from .feature_extraction_drama3 import Drama3FeatureExtractor, register_feature_extractor
from .processing_drama3 import Drama3Processor, register_processor

__version__ = "0.1.0"

integrations.warn_if_untested()
if integrations.device_dispatch_requested():
    integrations.install_device_dispatch()


def _register() -> None:
    # The published checkpoint stores routed experts one by one (`mlp.experts.E.gate_proj.weight`),
    # transformers' Qwen3.5-MoE fuses them (`mlp.experts.gate_up_proj`). transformers already knows
    # that conversion for its MoE models; registering it for the backbone's model_type applies it on
    # load and, reversed, on save, so saved files keep the published names.
    register_checkpoint_conversion_mapping(
        Drama3TextConfig.model_type, get_checkpoint_conversion_mapping("qwen2_moe"), overwrite=True
    )
    for config_class in (Drama3Config, Drama3TextConfig, Drama3AudioDecoderConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(Drama3Config, Drama3ForSpeechGeneration, exist_ok=True)
    AutoModelForTextToWaveform.register(Drama3Config, Drama3ForSpeechGeneration, exist_ok=True)
    register_feature_extractor()
    register_processor()


_register()

__all__ = [
    "Drama3AudioDecoderConfig",
    "Drama3Cache",
    "Drama3Config",
    "Drama3FeatureExtractor",
    "Drama3ForSpeechGeneration",
    "Drama3Output",
    "Drama3Processor",
    "Drama3TextConfig",
]
