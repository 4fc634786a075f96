"""The engine: step loop, its thread and async front, scheduling, checks, outputs, reports."""
