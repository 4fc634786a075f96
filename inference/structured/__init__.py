"""Structured output: grammars, their compiler and the per-step grammar masks."""
