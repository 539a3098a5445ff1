"""Building blocks below the model that import nothing of the package: rotary embeddings (`rope`,
shared by the backbone's tower and the codec), routed experts held in CPU memory
(`offloaded_experts`), and which modules the LoRA presets adapt (`lora_targets`, shared by training
and serving)."""
