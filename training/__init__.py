"""meshrun's training engine: runs on every rank. Never imports Hydra."""
