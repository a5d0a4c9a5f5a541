"""Sweeps: the summary callback and each point's record."""
