"""Markers by what a test needs, so test files carry few marks of their own (`make check` leaves both out):

- slurm: the dev Slurm cluster. Tests in a module marked `pytestmark = pytest.mark.slurm`, tests that
  take the `cluster` fixture, and tests skipped when the cluster is down (a skipif whose reason names the
  Slurm cluster).
- slow: multi-process runs. Tests that spawn ranks through tests/helpers/dist.py's run_distributed,
  directly or through a helper or fixture of their module; tests that start ranks another way (the CLI)
  or build a wheel say `@pytest.mark.slow` themselves.

The Slurm tests must run one after another (the dev cluster's three nodes are theirs, and a test that counts
idle nodes or its own jobs must not see another test's): make test runs them in a pytest process of their own
while the other tests run on pytest-xdist workers. Each also carries the xdist group "slurm" for runs that
use `--dist loadgroup` (with pytest 9.2 and xdist 3.8 here, loadgroup did not keep a group on one worker: do
not rely on it).

The shared helpers are the package tests/helpers/ (this directory is on sys.path: pytest inserts a rootdir
conftest's directory); test modules import from it, never from each other.
"""

from __future__ import annotations

import ast
import functools

import pytest

SPAWNERS = frozenset({"run_distributed"})

LONGEST_FIRST = (
    "tests/engine/test_compile_layers.py",
    "tests/launcher/hf/test_hf_interop.py",
    "tests/slurm/test_fault_matrix_slurm.py",
    "tests/launcher/sweep/test_sweep_plugin.py",
    "tests/launcher/manage/test_observability.py",
    "tests/engine/test_context_parallel.py",
    "tests/launcher/launch/test_run_dir_safety.py",
    "tests/engine/test_pipeline.py",
    "tests/launcher/recommend/test_recommend.py",
    "tests/engine/test_checkpoint_resume.py",
    "tests/bench/test_gpu_check.py",
    "tests/launcher/launch/test_preflight_local.py",
    "tests/launcher/manage/test_report.py",
    "tests/engine/test_zero_levers.py",
)
"""The files that took longest in make test's parallel part (most to least), collected first: with
`--dist loadfile --no-loadscope-reorder` (the Makefile) xdist hands files to its workers in collection order, so
the long ones start at once and the workers end together on short files, instead of one long file (xdist's own
order puts files with few tests last) running alone at the end."""


@functools.cache
def _spawning_functions(path: str) -> frozenset:
    """Module-level functions of the file at path that reach a spawner, through calls to each other."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    refs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = set()
            for n in ast.walk(node):
                if isinstance(n, ast.Name):
                    names.add(n.id)
                elif isinstance(n, ast.Attribute):
                    names.add(n.attr)
            refs[node.name] = names
    spawning = {name for name, names in refs.items() if names & SPAWNERS}
    grown = True
    while grown:  # a helper that calls a spawning helper spawns too
        more = {name for name, names in refs.items() if names & spawning} - spawning
        spawning |= more
        grown = bool(more)
    return frozenset(spawning)


def _needs_slurm_cluster(item: pytest.Item) -> bool:
    return any("slurm cluster" in str(m.kwargs.get("reason", "")).lower() for m in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if (
            _needs_slurm_cluster(item) or "cluster" in getattr(item, "fixturenames", ())
        ) and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        path, function = getattr(item, "path", None), getattr(item, "function", None)
        if item.get_closest_marker("slow") or path is None or function is None:
            continue
        # The test itself, or a fixture of its module by name (fixtures are functions of the module too).
        spawning = _spawning_functions(str(path))
        if function.__name__ in spawning or spawning.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    first = {name: k for k, name in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath)

    def rank(item: pytest.Item) -> int:
        path = str(getattr(item, "path", ""))
        rel = path[len(root) + 1 :] if path.startswith(root + "/") else path
        return first.get(rel, len(first))

    items[:] = sorted(items, key=rank)  # stable: a file's tests, and the other files, keep their order


@pytest.fixture(scope="module")
def cluster():
    """The dev Slurm cluster, started if needed; a loud skip with the reason when it cannot run here."""
    from helpers.slurm import start_cluster

    return start_cluster()


@pytest.fixture
def slurm_jobs():
    """A list the test appends each Slurm job id it submits to (an array's base id cancels every task);
    they are cancelled when the test ends, passed or failed, so a failed test leaves nothing queued or
    running for the tests after it (cancelling a finished job changes nothing)."""
    import helpers.jobs as noted

    jobs: list = []
    yield jobs
    noted.cancel(jobs)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed (in setup or in its body) cancels the Slurm jobs noted while it ran
    (tests/helpers/jobs.py: every job tests/slurm/test_slurm_cluster.py's meshrun() saw submitted)."""
    outcome = yield
    report = outcome.get_result()
    import sys

    noted = sys.modules.get("helpers.jobs")
    if noted is None:
        return
    if report.failed and report.when in ("setup", "call"):
        noted.cancel(noted.submitted)
    if report.when == "teardown" or report.failed:
        noted.submitted.clear()


@pytest.fixture
def drawn(monkeypatch):
    """What the report really draws: every figure's axes (title, lines with their data and style, bar heights,
    annotations), recorded as matplotlib saves it; read back instead of asking the report's own helpers."""
    import matplotlib.figure

    figures = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        ax = fig.axes[0]
        figures[ax.get_title()] = {
            "lines": [
                (
                    ln.get_label(),
                    [float(x) for x in ln.get_xdata()],
                    [float(y) for y in ln.get_ydata()],
                    ln.get_linestyle(),
                    ln.get_color(),
                )
                for ln in ax.get_lines()
            ],
            "texts": [(t.get_text(), float(t.xy[0])) for t in ax.texts],
            "bars": [(p.get_x() + p.get_width() / 2, p.get_height()) for p in ax.patches],
        }
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return figures


@pytest.fixture(scope="module", autouse=True)
def _module_process_state(tmp_path_factory):
    """What a test file changes in this pytest process stays with the file (tests audit 2026-12-03, flaky 12):
    torch's intra-op thread count (fixtures set 1 for their in-process reference runs) is given back after the
    file, so a later file on the same xdist worker does not run single-threaded because of the order files came
    in; and `tempfile.mkdtemp()` without a directory lands in a per-file folder under pytest's basetemp (which
    pytest prunes), not in /tmp for good."""
    import sys
    import tempfile

    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    previous = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("mkdtemp"))
    try:
        yield
    finally:
        tempfile.tempdir = previous
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(threads if threads is not None else _DEFAULT_THREADS)


def _default_threads() -> int:
    """torch's default intra-op thread count in this process (OMP_NUM_THREADS, else the usable cores)."""
    import os

    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, len(os.sched_getaffinity(0)))


_DEFAULT_THREADS = _default_threads()
