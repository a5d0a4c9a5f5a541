"""bench/gpu_check.sh --dry's one-rank steps that need no launcher, run in ONE process (torch and the engine
imported once instead of three times): the saved-activations probe (bench/saved_bytes.py RUN_DIR),
bench/gpu_memory_levers.py --dry and bench/gpu_engine_features.py --dry. Each step is the module's own main()
with its own arguments, run in turn; what it printed, what it wrote to stderr and its exit status are kept
apart, so gpu_check.sh judges each exactly as it judges the separate processes it runs on a GPU (where each
step needs a fresh process: the allocator figures count from an empty device). Each one-rank gloo group gets a
free port of its own (several checkouts may run this on one machine).

Usage: python bench/gpu_dry_steps.py TRAIN_RUN_DIR LEVERS_OUT FEATURES_OUT
Prints one JSON object: {"saved_bytes"|"memory_levers"|"engine_features": {"rc", "stdout", "stderr"}}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _step(main, argv) -> dict:
    """main's exit status and output; an exception is a failed step (its traceback on stderr), not a crash of
    the others."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    from training.run.local_ranks import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    try:
        sys.argv = argv
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main()
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        sys.argv = saved_argv
    return {"rc": int(rc or 0), "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    train_dir, levers_out, features_out = sys.argv[1:]
    import gpu_engine_features
    import gpu_memory_levers
    import saved_bytes

    results = {
        "saved_bytes": _step(lambda: saved_bytes.main([train_dir]), ["saved_bytes"]),
        "memory_levers": _step(gpu_memory_levers.main, ["gpu_memory_levers.py", "--dry", "--out", levers_out]),
        "engine_features": _step(gpu_engine_features.main, ["gpu_engine_features.py", "--dry", "--out", features_out]),
    }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
