"""Data on the launcher's side: indexed dataset resolution and action=prepare."""
