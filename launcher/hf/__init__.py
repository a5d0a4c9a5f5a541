"""Hugging Face actions in the launcher: train.init_from checks, action=export, action=generate."""
