"""Writes the resolved configuration into a run directory: config.json for the ranks, config.yaml for people."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from training.config import Config, save_config


def write_config(cfg: Config, run_dir: str) -> None:
    """run_dir/config.json (what every rank reads) and run_dir/config.yaml (DESIGN's resolved config)."""
    os.makedirs(run_dir, exist_ok=True)
    save_config(cfg, os.path.join(run_dir, "config.json"))
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
