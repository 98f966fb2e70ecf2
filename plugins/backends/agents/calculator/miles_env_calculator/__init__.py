"""Arithmetic tasks solved with a calculate tool: a safe evaluator, an agent, task files."""
