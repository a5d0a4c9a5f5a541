"""The import graph of launcher/ and training/, read statically (every import statement, those inside functions
too): no circle between modules; launcher/ never imports torch, training/ never imports Hydra, OmegaConf or launcher/.
A circle hidden by an import inside a function still ties the modules together: this test sees it."""

from __future__ import annotations

import ast
import os

from helpers.modules import PACKAGES, package_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, above tests/


def _modules() -> dict[str, str]:
    return package_modules(ROOT, PACKAGES)


def _imports(path: str) -> list[str]:
    """Every module name an import statement of the file names (`from a.b import c`: a.b and a.b.c)."""
    names = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _graph(mods: dict[str, str]) -> dict[str, set[str]]:
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imported in _imports(path):
            if imported not in mods or imported == name:
                continue
            # `from pkg import sub` imports the submodule: the edge goes to pkg.sub, not to pkg's __init__ as well
            # (a package's __init__ that imports its own submodules would otherwise count as a circle).
            deps.add(imported)
        for d in list(deps):
            if any(o.startswith(d + ".") for o in deps) and not _imports_names_of(mods[name], d, mods):
                deps.discard(d)
        graph[name] = deps
    return graph


def _imports_names_of(path: str, pkg: str, mods: dict[str, str]) -> bool:
    """Whether the file takes a name from pkg's __init__ itself (not only submodules of pkg)."""
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module == pkg and node.level == 0:
            if any(f"{pkg}.{a.name}" not in mods for a in node.names):
                return True
        if isinstance(node, ast.Import) and any(a.name == pkg for a in node.names):
            return True
    return False


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_between_modules():
    graph = _graph(_modules())
    circles = _cycles(graph)
    detail = "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in circles
    )
    assert not circles, "import circles (cut them at the names that tie the modules):\n" + detail


def test_the_circle_finder_finds_a_circle_hidden_in_a_function(tmp_path):
    # The checker itself: two modules that import each other, one of them inside a function.
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("import a\n")
    mods = {m: str(tmp_path / f"{m}.py") for m in ("a", "b", "c")}
    assert _cycles(_graph(mods)) == [["a", "b"]]


def test_launcher_never_imports_torch_and_training_never_imports_hydra():
    # training/ runs on every rank and is handed only the typed config: it never reaches back into the launcher.
    wrong = []
    for name, path in _modules().items():
        banned = ("torch",) if name.startswith("launcher") else ("hydra", "omegaconf", "launcher")
        for imported in _imports(path):
            if imported.split(".")[0] in banned:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, wrong


def _module_level_imports(path: str) -> list[str]:
    """Imports that run when the module is imported (module level, not inside functions or TYPE_CHECKING)."""
    names = []
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return names


def test_no_launcher_module_loads_torch_on_import():
    # Transitively: a launcher module imports training modules (and their packages' __init__), which must then
    # be torch-free at import time. Static, so that it costs no interpreter start.
    mods = _modules()
    seen: set[str] = set()
    todo = [n for n in mods if n.startswith("launcher")]
    chain: dict[str, str] = {}
    wrong = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        for imported in _module_level_imports(mods[name]) + [p for p in parents if p in mods]:
            if imported.split(".")[0] == "torch":
                path, at = [name], name
                while at in chain:
                    at = chain[at]
                    path.append(at)
                wrong.append(" <- ".join(path))
            elif imported in mods and imported not in seen:
                chain.setdefault(imported, name)
                todo.append(imported)
    assert not wrong, "torch imported on import of a launcher module:\n" + "\n".join(wrong)


def test_the_planner_imports_nothing_from_the_rest_of_the_launcher_nor_reads_the_machine():
    # launcher/plan/ is the model a 64-point sweep runs per point: pure arithmetic on the config (its __init__ says
    # so). What looks at the machine (NUMA nodes, PATH, file systems, datasets) is the launch gate's
    # (launcher/launch/host_checks.py); the layout search is launcher/recommend/'s.
    wrong = [
        f"{name} imports {imported}"
        for name, path in _modules().items()
        if name == "launcher.plan" or name.startswith("launcher.plan.")
        for imported in _imports(path)
        if imported.split(".")[0] == "launcher" and imported.split(".")[:2] != ["launcher", "plan"]
    ]
    assert not wrong, wrong
    probes = []
    for name, path in _modules().items():
        if name == "launcher.plan" or name.startswith("launcher.plan."):
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("listdir", "scandir", "walk"):
                    probes.append(f"{name}:{node.lineno} lists a directory")
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if node.value.startswith(("/sys/", "/proc/")) or node.value in ("/sys", "/proc"):
                        probes.append(f"{name}:{node.lineno} names {node.value}")
    assert not probes, probes
