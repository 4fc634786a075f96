"""Text: tokenizers, chat templates, segment rendering, tool calls, context and turn planning."""
