"""`runs/latest` and `multirun/latest`: a symbolic link to the newest run or sweep, so that
`meshrun action=status run.dir=runs/latest` and `action=logs` need no timestamp copied.

The link is relative (it names the sibling directory), replaced atomically (a new link renamed over the old),
and kept only where it cannot surprise: in a folder named `runs` or `multirun` (the defaults' folders) or one
that already holds such a link. A real file or directory called `latest` is never touched. No torch.
"""

from __future__ import annotations

import os
import sys

from training.contract.rundir.files import symlink_atomic

LINK = "latest"
LINK_FOLDERS = ("runs", "multirun")


def resolve_latest(path: str) -> str:
    """`path` with a final `latest` link followed (once): the run it names, so a resumed run, its lock and its
    config.json record the real directory, never the link that moves on to the next run."""
    if os.path.basename(os.path.normpath(path)) == LINK and os.path.islink(path):
        target = os.readlink(path)
        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), target))
    return path


def point_latest(run_dir: str) -> bool:
    """Make `<parent of run_dir>/latest` name run_dir; returns whether it does. Errors are warnings: the link
    is a convenience and never stops a launch."""
    run_dir = os.path.abspath(run_dir)
    parent, name = os.path.split(run_dir)
    link = os.path.join(parent, LINK)
    if name == LINK or not os.path.isdir(parent):
        return False
    if not (os.path.basename(parent) in LINK_FOLDERS or os.path.islink(link)):
        return False
    if os.path.lexists(link) and not os.path.islink(link):
        return False  # someone's own file or directory: left alone
    try:
        symlink_atomic(name, link)
    except OSError as exc:
        print(f"meshrun: warning: could not point {link} at {name} ({exc.strerror})", file=sys.stderr)
        return False
    return True
