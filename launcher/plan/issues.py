"""One finding about a configuration (validate, the honest checks, recommend and elastic resizing report them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Issue:
    """One finding about the configuration."""

    level: str
    """error (nothing runs) | warning (runs, but costly) | note (for information)."""
    key: str
    """The config key(s) concerned, as the user would override them."""
    message: str
    """What is wrong, with the numbers."""
    fix: str = ""
    """What to change (concrete overrides where possible)."""
    code: str = ""
    """Machine-readable kind: e.g. no_fit for a model that does not fit."""

    def __str__(self) -> str:
        text = f"{self.level}: {self.key}: {self.message}"
        return text + (f"\n    fix: {self.fix}" if self.fix else "")

    def to_json(self) -> dict:
        return {"level": self.level, "key": self.key, "message": self.message, "fix": self.fix, "code": self.code}
