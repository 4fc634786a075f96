"""Transports: the adapters that carry turns to clients (WebSocket frames, SSE, OpenAI's
Chat Completions, the AI SDK's UI message stream)."""
