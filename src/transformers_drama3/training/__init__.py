"""Training: datasets -> codes, collators, packing, Muon, LoRA presets, reward model, GRPO.

See docs/training.md.
"""

from .collators import (
    CloningCollator,
    DialogueCollator,
    InfillCollator,
    LineByLineCollator,
    ReferencePool,
    RowCollator,
    StreamingCollator,
    TTSCollator,
)
from .data import PreparationReport, load_speech_records, prepare_dataset
from .optim import MuonWithAdamW, build_optimizer, split_parameters
from .packing import PackingCollator, pack_greedy, unpack
from .trainer import Drama3Trainer, drama3_loss
from .grpo import GRPOConfig, GRPOTrainer, Prompt, Takes, pairwise_advantages, rollout, standardise
from .lora import apply_lora, lora_config, merge_and_save
from .reward import (
    Drama3ForRewardModeling,
    PreferenceCollator,
    bradley_terry_loss,
    preference_accuracy,
)
