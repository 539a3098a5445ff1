"""Fish Audio Drama 3 for Hugging Face Transformers.

`import transformers_drama3` registers the model and processor with the Auto classes, so that
`AutoModel.from_pretrained(path)` loads a published Drama 3 checkpoint (`model_type` "fish_omni"),
`AutoProcessor` its tokenizer and codec, and `pipeline("text-to-speech", model=path)` speaks.
It also routes the backbone's Gated DeltaNet functions by device (fla for CUDA tensors, PyTorch
otherwise; see `integrations.install_device_dispatch`, and `DRAMA3_DEVICE_DISPATCH=0` to opt out).
"""

from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTextToWaveform,
    AutoProcessor,
)

from . import integrations
from .codec import (
    Drama3CodecConfig,
    Drama3CodecModel,
    Drama3MelCodecConfig,
    Drama3MelCodecModel,
    Drama3PhoneCodecConfig,
    Drama3PhoneCodecModel,
)
from .configuration_drama3 import Drama3AudioDecoderConfig, Drama3Config, Drama3TextConfig
from .feature_extraction_drama3 import Drama3FeatureExtractor
from .modeling_drama3 import Drama3ForSpeechGeneration, Drama3Model, Drama3Output
from .modeling_drama3_reward import Drama3ForRewardModeling
from .processing_drama3 import Drama3Processor
from .decoding.state import DecodeCache
from .layers.offloaded_experts import expert_cache_stats, offload_experts
from .placement.planning import plan_memory, plan_options

__version__ = "0.1.0"

CODECS = {
    Drama3CodecConfig: Drama3CodecModel,
    Drama3MelCodecConfig: Drama3MelCodecModel,
    Drama3PhoneCodecConfig: Drama3PhoneCodecModel,
}


def register_auto_classes() -> None:
    """Make transformers' Auto classes know Drama 3 (idempotent; `import transformers_drama3` calls it).

    The one place that registers: the configs (the model's "fish_omni" and its sub-configs, the
    codecs' "drama3_codec", "drama3_mel_codec" and "drama3_phone_codec"), the speech model for `AutoModel` and
    `AutoModelForTextToWaveform` (the text-to-speech pipeline), the codecs for `AutoModel` (the
    processor loads its `codec/` folder through it), the feature extractor and the processor, and
    the reward model for `AutoModelForSequenceClassification` (one score per take), and the
    published per-expert tensor names of the backbone."""
    for config_class in (Drama3Config, Drama3TextConfig, Drama3AudioDecoderConfig, *CODECS):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for auto_class in (AutoModel, AutoModelForTextToWaveform):
        auto_class.register(Drama3Config, Drama3ForSpeechGeneration, exist_ok=True)
    for config_class, codec_class in CODECS.items():
        AutoModel.register(config_class, codec_class, exist_ok=True)
    AutoFeatureExtractor.register(Drama3Config, Drama3FeatureExtractor, exist_ok=True)
    AutoProcessor.register(Drama3Config, Drama3Processor, exist_ok=True)
    AutoModelForSequenceClassification.register(Drama3Config, Drama3ForRewardModeling, exist_ok=True)
    integrations.use_per_expert_checkpoint_names(Drama3TextConfig.model_type)


integrations.warn_if_untested()
if integrations.device_dispatch_requested():
    integrations.install_device_dispatch()
register_auto_classes()

__all__ = [
    "register_auto_classes",
    "Drama3AudioDecoderConfig",
    "Drama3Config",
    "Drama3FeatureExtractor",
    "Drama3ForRewardModeling",
    "Drama3ForSpeechGeneration",
    "Drama3Model",
    "Drama3Output",
    "DecodeCache",
    "expert_cache_stats",
    "offload_experts",
    "plan_memory",
    "plan_options",
    "Drama3Processor",
    "Drama3TextConfig",
]
