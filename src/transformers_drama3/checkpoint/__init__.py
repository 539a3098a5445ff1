"""Checkpoint I/O: reading, checking, writing and converting the published checkpoint's files.

- `files`: checks of a checkpoint folder before transformers reads it (an incomplete download is
  one line naming the file);
- `loaded_checkpoint`: what a model was loaded from, and the published-layout tensors that write
  it back unchanged;
- `writer`: safetensors shards and index, written atomically;
- `saving`: `save_pretrained` / `push_to_hub` in the published layout;
- `quantization/`: the block-FP8 rule of the routed experts;
- `qwen_init`: a Drama 3 model started from a Qwen3.5-MoE checkpoint.

The package imports nothing here, so that the model (which loads and saves through these
modules) and `qwen_init` (which builds the model) both import its modules one way.
"""
