"""`import transformers_drama3` registers Drama 3 with transformers' Auto classes, from one function."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING, MODEL_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

import transformers_drama3
from transformers_drama3 import (
    Drama3AudioDecoderConfig,
    Drama3Config,
    Drama3FeatureExtractor,
    Drama3ForSpeechGeneration,
    Drama3Processor,
    Drama3TextConfig,
    integrations,
)
from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel, Drama3MelCodecConfig, Drama3MelCodecModel

PACKAGE = Path(transformers_drama3.__file__).parent


def test_every_config_is_known_by_its_model_type():
    for config_class in (Drama3Config, Drama3TextConfig, Drama3AudioDecoderConfig, Drama3CodecConfig, Drama3MelCodecConfig):
        assert CONFIG_MAPPING[config_class.model_type] is config_class


def test_the_auto_classes_map_drama3_configs_to_drama3_classes():
    assert MODEL_MAPPING[Drama3Config] is Drama3ForSpeechGeneration
    assert MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING[Drama3Config] is Drama3ForSpeechGeneration
    assert MODEL_MAPPING[Drama3CodecConfig] is Drama3CodecModel
    assert MODEL_MAPPING[Drama3MelCodecConfig] is Drama3MelCodecModel
    assert FEATURE_EXTRACTOR_MAPPING[Drama3Config] is Drama3FeatureExtractor
    assert PROCESSOR_MAPPING[Drama3Config] is Drama3Processor


def test_the_backbone_loads_and_saves_experts_under_the_published_per_expert_names():
    ours = get_checkpoint_conversion_mapping(Drama3TextConfig.model_type)
    assert repr(ours) == repr(get_checkpoint_conversion_mapping(integrations.PER_EXPERT_MODEL_TYPE))


def test_registering_again_changes_nothing():
    transformers_drama3.register_auto_classes()
    transformers_drama3.register_auto_classes()
    assert MODEL_MAPPING[Drama3Config] is Drama3ForSpeechGeneration
    assert PROCESSOR_MAPPING[Drama3Config] is Drama3Processor


def test_a_lost_per_expert_conversion_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr(integrations.conversion_mapping, "get_checkpoint_conversion_mapping", lambda model_type: None)
    with pytest.raises(integrations.InternalsChanged, match=r"get_checkpoint_conversion_mapping\('qwen2_moe'\)"):
        integrations.use_per_expert_checkpoint_names(Drama3TextConfig.model_type)


AUTO_REGISTRATION = re.compile(r"\bAuto\w+\.register\(|register_checkpoint_conversion_mapping\(")


def test_only_register_auto_classes_registers_with_the_auto_classes():
    """One place to read what transformers learns about Drama 3 (integrations.py holds the guarded
    conversion-mapping call that register_auto_classes makes)."""
    allowed = {"__init__.py", "integrations.py"}
    registering = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if AUTO_REGISTRATION.search(path.read_text(encoding="utf-8"))
    }
    assert registering <= allowed, sorted(registering - allowed)


def test_the_reward_model_is_registered_without_importing_the_training_code():
    check = (
        "import sys, transformers_drama3\n"
        "from transformers import AutoConfig, AutoModelForSequenceClassification\n"
        "from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING as mapping\n"
        "from transformers_drama3 import Drama3Config, Drama3ForRewardModeling\n"
        "assert mapping[Drama3Config] is Drama3ForRewardModeling\n"
        "print('training imported' if 'transformers_drama3.training' in sys.modules else 'training not imported')\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "training not imported" in result.stdout
