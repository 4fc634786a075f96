"""Model execution: tokenizers, chat templates, the model and the engine that runs it."""
