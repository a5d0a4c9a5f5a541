"""The modules of the project's packages as files, for the tests that read the import graph statically
(tests/repo/test_import_graph.py, tests/repo/test_folder_ties.py)."""

from __future__ import annotations

import os

PACKAGES = ("launcher", "training")


def package_modules(root: str, packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Dotted module name -> file, for every .py file under root/<package> (a package's __init__ is the package)."""
    out = {}
    for top in packages:
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                    out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = os.path.join(d, f)
    return out
