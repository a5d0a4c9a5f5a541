"""Launching: the gate every launch passes (validate + plan), claiming the run directory, the local launcher,
preflight and the rehearsal. The rank processes themselves are launcher/ranks/'s, shared with Slurm."""
