"""The model: config, weights and GGUF import, layers and linear plans, the runner, sampling."""
