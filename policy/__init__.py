"""The model: loading, chat codec, generation backends, GRPO loss."""
