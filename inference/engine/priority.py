"""Request priorities (lower runs first, like vLLM's). Requests above PRIORITY_NORMAL are
background work (history summaries): the scheduler gives them only what normal requests leave
each step (see inference.engine.scheduler). Importing this costs nothing."""

PRIORITY_NORMAL = 0
PRIORITY_LOW = 1
