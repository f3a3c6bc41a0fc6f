"""Seeing inside a run: read the per-step trace, print it as a table, draw it, explain it."""
