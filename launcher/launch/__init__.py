"""Launching on this machine: local rank processes, NUMA binding, nsys, preflight."""
