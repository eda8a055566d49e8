"""Experiments as pure functions from replay results to tables and figures (no printing)."""
