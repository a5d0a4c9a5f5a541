"""JSON Lines read in bounded pieces (pure Python): events.jsonl, metrics.jsonl and the other run-directory logs.

meshrun writes lines of a few hundred bytes (an event naming every rank of a large job: some hundred kB). A
regular file of one huge line (a damaged or hostile run directory) was read whole by `for line in f` and
`readlines()`, as much memory as the file is long. Here no line longer than MAX_LINE_BYTES is ever held: it is
skipped in 1 MiB pieces up to its newline, and the reader says so once on stderr (docs/USER_CONTRACTS.md,
*Hostile and malformed input*).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import IO, Any

MAX_LINE_BYTES = 16 << 20
"""The longest line a reader takes (16 MiB): far above any line meshrun writes."""
_SKIP_PIECE = 1 << 20


def bounded_lines(f: IO[bytes], max_bytes: int = MAX_LINE_BYTES, name: str = "") -> Iterator[bytes]:
    """The lines of a binary file, each at most max_bytes long (its newline not counted); a longer one is skipped
    without being held, with one note on stderr per file naming `name`."""
    skipped = 0
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            break
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while True:  # the rest of the over-long line, in bounded pieces
                rest = f.readline(_SKIP_PIECE)
                if not rest or rest.endswith(b"\n"):
                    break
            skipped += 1
            continue
        yield line
    if skipped:
        print(
            f"meshrun: skipped {skipped} line(s) longer than {max_bytes >> 20} MiB in {name or 'a JSON Lines file'} "
            "(meshrun writes none: a damaged or edited file)",
            file=sys.stderr,
        )


def read_objects(path: str, max_bytes: int = MAX_LINE_BYTES) -> Iterator[Any]:
    """The parsed JSON values of a regular file's lines (a torn or malformed line is skipped, and so is an
    over-long one, see bounded_lines); nothing for a missing file or one that is not regular (a FIFO would block
    the reader, /dev/zero never end)."""
    from training.contract.rundir.files import open_regular

    try:
        f = open_regular(path, binary=True)
    except OSError:
        return
    with f:
        for line in bounded_lines(f, max_bytes, os.path.basename(path)):
            try:
                yield json.loads(line.decode("utf-8", "replace"))  # as the text readers decoded before
            except ValueError:  # a torn line
                continue
