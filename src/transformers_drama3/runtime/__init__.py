"""Running the model for a command or a server: the `drama3` command line's arguments (`command_line`,
standard library only, so `--help` imports no torch), loading a model and processor with the
error a user can fix (`loading`), long texts and scenes (`long_form`), and starting a model from
Qwen3.5 weights (`qwen_init`). Above the model; below serving and the command line."""
