"""The names of `meshrun action=NAME`: the config's `action` choices (training/contract/config.py). The table that
runs them (module, function, lock, how the config is resolved, a summary) is the launcher's, launcher/cli/actions.py,
in this order; tests/launcher/cli/test_action_table.py holds the two equal. Ranks never read the action."""

from __future__ import annotations

ACTION_NAMES: tuple[str, ...] = (
    "train",
    "plan",
    "rehearse",
    "recommend",
    "prepare",
    "status",
    "runs",
    "logs",
    "cancel",
    "report",
    "preflight",
    "keys",
    "export",
    "generate",
)
