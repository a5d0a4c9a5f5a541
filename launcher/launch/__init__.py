"""Launching: the gate every launch passes (validate + plan), claiming the run directory, the cluster kinds' backends
(backend.py: the Backend protocol and BACKENDS; local_backend.py, slurm_backend.py), the local launcher, preflight
and the rehearsal. The rank processes themselves are launcher/ranks/'s, shared with Slurm."""
