"""A rank's start-up timeline and its exit (training/observe/startup.py, training/main.py): the process start
read from /proc, and an exit that skips only the interpreter's teardown (threads joined, atexit handlers run,
output flushed, the exit code kept)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from helpers import ROOT

from training.observe import startup


def test_process_start_is_read_from_the_kernel_not_from_the_first_python_line():
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(0.3); from training.observe import startup; "
            "print(startup.process_start_time(), time.time())",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    started, now = float(out[0]), float(out[1])
    # Started after we asked for it (within /proc's 10 ms ticks) and at least the sleep before the Python line.
    assert before - 0.05 <= started <= now - 0.3
    assert startup.process_start_time("not-a-pid") is None


def test_timeline_keeps_the_first_mark_and_orders_by_time(monkeypatch):
    monkeypatch.setattr(startup, "_MARKS", {})
    monkeypatch.setenv(startup.TASK_START_ENV, "1000.5")
    startup.mark("a")
    first = startup._MARKS["a"]
    startup.mark("b")
    startup.mark("a")  # a phase ends once
    marks = startup.timeline()
    assert list(marks) == ["task_start", "process_start", "a", "b"] and marks["task_start"] == 1000.5
    assert marks["a"] == round(first, 3) <= marks["b"]


def test_exit_without_finalising_joins_threads_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    script = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from training.run.quick_exit import exit_without_finalising
        def late_write():
            time.sleep(0.5)
            open({str(tmp_path / "thread")!r}, "w").write("done")
        threading.Thread(target=late_write).start()  # not a daemon: Python would wait for it
        from concurrent.futures import ThreadPoolExecutor
        ThreadPoolExecutor(max_workers=1).submit(time.sleep, 0)  # an idle worker stays: it must not hang the exit
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
        sys.stdout.write("unflushed")  # no newline, no flush
        exit_without_finalising(3)
        print("never")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 3 and res.stdout == "unflushed"
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"


def test_a_rank_that_refuses_its_input_ends_without_the_interpreters_teardown(tmp_path):
    """The hostile audit's D14: in 2 of 28 exit-2 refusals the rank died of SIGABRT ("terminate called without an
    active exception") in the interpreter's finalisation with libtorch loaded, and the launcher reported a signal
    death (on Slurm: the node implicated). An exit-2 rank now ends as a completed one does: atexit handlers run,
    output flushed, code kept, and no finalisation (a module global's __del__ at teardown never runs)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import atexit, json, os
            class _Teardown:
                def __del__(self, _write=os.write):
                    _write(2, b"FINALISED\\n")
            json._teardown_marker = _Teardown()  # collected when the interpreter tears its modules down
            atexit.register(lambda: os.write(2, b"ATEXIT\\n"))
            """
        )
    )
    res = subprocess.run(
        [sys.executable, "-m", "training.main", str(tmp_path / "no-such-run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{inject}:{ROOT}", "RANK": "0", "WORLD_SIZE": "1"},
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "ATEXIT" in res.stderr and "FINALISED" not in res.stderr, res.stderr[-2000:]
