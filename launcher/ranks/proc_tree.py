"""The process tree as /proc shows it: whose child each process is, and how much memory it holds.

The one reader of /proc/PID/stat's parent and resident-set fields: a local cancel finds a launcher's ranks among
its children (launcher/manage/cancel.py), and the data benchmark sums the memory of a process and its workers
(bench/bench_data.py).
"""

from __future__ import annotations

import os

PROC = "/proc"


def _stat_fields(proc_root: str, pid: str) -> list[str]:
    """/proc/PID/stat's fields after the command name (OSError, IndexError when pid is gone or unreadable)."""
    with open(os.path.join(proc_root, pid, "stat")) as f:
        # The command name, in parentheses, may itself hold spaces and parentheses: split after its end.
        return f.read().rsplit(")", 1)[1].split()


def process_table(proc_root: str = PROC) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, resident set in bytes) of every process readable now; one that ends while it is read is
    left out."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = {}
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            fields = _stat_fields(proc_root, name)
            out[int(name)] = (int(fields[1]), int(fields[21]) * page)
        except (OSError, IndexError, ValueError):
            continue
    return out


def parent_of(pid: int, proc_root: str = PROC) -> int | None:
    """The parent of pid, None when pid is gone or unreadable."""
    try:
        return int(_stat_fields(proc_root, str(pid))[1])
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int, table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Processes whose parent is pid (read now unless a process_table is given)."""
    table = process_table() if table is None else table
    return [child for child, (parent, _) in table.items() if parent == pid]


def descendants(pid: int, table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """pid's children, their children, and so on down (pid itself not included)."""
    table = process_table() if table is None else table
    out: list[int] = []
    stack = [pid]
    while stack:
        below = children(stack.pop(), table)
        out += below
        stack += below
    return out
