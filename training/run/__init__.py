"""Run control on a rank: the training loop, stop signals and the launcher watch."""
