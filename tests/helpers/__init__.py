"""What the tests share, in one place (tests/conftest.py puts tests/ on sys.path; no test module imports another):

- helpers.dist: run a function on N spawned gloo ranks and collect their results (the multi-process tests);
- helpers.cli: `meshrun ARGS` in-process, and a Config composed from conf/ as the CLI composes it;
- helpers.slurm: the dev Slurm cluster as the tests use it (start or skip, submit, wait, read a run's metrics);
- helpers.jobs: the Slurm jobs the running test submitted, cancelled when it fails;
- helpers.checkpoint: the checkpoint tests' stand-in model and one-process save/resume steps;
- helpers.doubles: NVML and InfiniBand sysfs doubles written as the real ones speak;
- helpers.megatron_format: an independent reader and writer of the Megatron .bin/.idx format.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository's root (tests/helpers/__init__.py is three levels below it)."""
