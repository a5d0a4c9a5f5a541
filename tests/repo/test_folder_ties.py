"""Folders of launcher/ and training/ form layers: no two folders import each other (a folder is the directory a
module sits in; a package and its own sub-packages do not count as a pair). Module circles are the import-graph
test's; this one also catches the tie of two folders whose modules never form a circle (a.x imports b.y while b.z
imports a.w), which is what makes a folder impossible to read or move on its own. Every import statement counts,
those inside functions too."""

from __future__ import annotations

import ast
import os

from helpers.modules import PACKAGES, package_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, above tests/


def _modules() -> dict[str, str]:
    return package_modules(ROOT, PACKAGES)


def _folder(module: str, mods: dict[str, str]) -> str:
    """The folder a module sits in: a package's __init__ sits in the package's own folder."""
    if mods[module].endswith("__init__.py"):
        return module
    return module.rpartition(".")[0]


def _imported(path: str, module: str, mods: dict[str, str]) -> set[str]:
    """The modules of launcher/ and training/ that the file imports (relative imports resolved)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        out.update(n for n in names if n in mods)
    return out


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the import statements behind the edge, as 'file -> module'."""
    mods = _modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in mods.items():
        src = _folder(module, mods)
        for target in _imported(path, module, mods):
            dst = _folder(target, mods)
            if not _nested(src, dst):
                edges.setdefault((src, dst), []).append(f"{os.path.relpath(path, ROOT)} -> {target}")
    return edges


def test_no_two_folders_import_each_other():
    edges = folder_edges()
    ties = [
        f"{a} <-> {b}:\n    " + "\n    ".join(sorted(edges[(a, b)]) + sorted(edges[(b, a)]))
        for (a, b) in sorted(edges)
        if a < b and (b, a) in edges
    ]
    assert not ties, "folders that import each other (move the shared part one floor down):\n" + "\n".join(ties)


def test_the_check_sees_a_tie_through_a_relative_import_inside_a_function(tmp_path, monkeypatch):
    # The test is only as good as its reading of imports: a tie made by a relative import inside a function must count.
    for rel, text in {
        "launcher/__init__.py": "",
        "launcher/a/__init__.py": "",
        "launcher/a/x.py": "def f():\n    from ..b import y\n",
        "launcher/b/__init__.py": "",
        "launcher/b/y.py": "from launcher.a import x\n",
        "training/__init__.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    edges = folder_edges()
    assert ("launcher.a", "launcher.b") in edges and ("launcher.b", "launcher.a") in edges
