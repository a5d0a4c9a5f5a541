"""Every import in bench/ resolves: the benchmarks are not run by the test suite, so a module that moved would
otherwise only show when someone runs `make bench`. And bench/ stands on the product alone: no benchmark imports
tests/ (the rank harness both use is training/run/local_ranks.py) or puts tests/ on sys.path."""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Iterator

from helpers import ROOT

SEARCH = [ROOT, os.path.join(ROOT, "bench")]
"""Where the benchmarks look for modules: the repository root they put on sys.path, and bench/ (a script's own
folder)."""

TESTS_TOPS = {"tests"} | {
    os.path.splitext(n)[0]
    for n in os.listdir(os.path.join(ROOT, "tests"))
    if not n.startswith((".", "__")) and not os.path.exists(os.path.join(ROOT, n))
}
"""Module names that can only come from tests/: the folder itself and what sits at its top (helpers, conftest),
leaving out the test folders named like the packages they test (launcher, training)."""


def _imports(path: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import in the file, those inside functions included."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _local(module: str) -> bool:
    """True if the module's file or package is in one of the SEARCH folders."""
    parts = module.split(".")
    for base in SEARCH:
        stem = os.path.join(base, *parts)
        if os.path.isfile(stem + ".py") or os.path.isfile(os.path.join(stem, "__init__.py")):
            return True
    return False


def _top_is_local(module: str) -> bool:
    top = module.split(".")[0]
    return any(os.path.isfile(os.path.join(b, top + ".py")) or os.path.isdir(os.path.join(b, top)) for b in SEARCH)


def test_every_bench_import_resolves():
    bench = os.path.join(ROOT, "bench")
    missing: list[str] = []
    files = sorted(f for f in os.listdir(bench) if f.endswith(".py"))
    assert files, "no benchmarks found"
    for name in files:
        for line, module in _imports(os.path.join(bench, name)):
            if _top_is_local(module):
                ok = _local(module)
            else:  # an installed package: finding its top level imports nothing
                ok = importlib.util.find_spec(module.split(".")[0]) is not None
            if not ok:
                missing.append(f"bench/{name}:{line}: {module}")
    assert not missing, "imports that do not resolve:\n" + "\n".join(missing)


def _bench_files() -> list[str]:
    bench = os.path.join(ROOT, "bench")
    return [os.path.join(bench, f) for f in sorted(os.listdir(bench)) if f.endswith(".py")]


def test_no_bench_file_imports_tests():
    found = [
        f"bench/{os.path.basename(path)}:{line}: {module}"
        for path in _bench_files()
        for line, module in _imports(path)
        if module.split(".")[0] in TESTS_TOPS
    ]
    assert not found, "benchmarks importing tests/ (use the product's module instead):\n" + "\n".join(found)


def test_no_bench_file_puts_tests_on_sys_path():
    found = []
    for path in _bench_files():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append"):
                if any(isinstance(c, ast.Constant) and c.value == "tests" for c in ast.walk(node)):
                    found.append(f"bench/{os.path.basename(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "benchmarks putting tests/ on sys.path:\n" + "\n".join(found)
