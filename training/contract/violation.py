"""One broken rule of a layout or a config (pure Python): what every rule module returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One broken rule."""

    level: str
    """error (the layout cannot run) | warning (it runs, differently from what was asked)."""
    key: str
    """The config key concerned, as the user would override it."""
    message: str
    """What is wrong, with the numbers."""
    fix: str
    """What to change (concrete overrides where possible)."""
    code: str = ""
    """Machine-readable kind of the rule."""

    def __str__(self) -> str:
        return f"{self.key}: {self.message}; fix: {self.fix}"
