"""The turn pipeline: a stored conversation's turn from the new message to the stored reply
(planning, prompt building, generation, events, summaries, locks and idempotency)."""
