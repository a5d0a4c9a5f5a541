"""`meshrun action=export run.dir=D export.output=DIR [export.step=N]`: D's checkpoint as a Hugging Face model.

The conversion needs torch, which the launcher never imports: it runs as `python -m training.hf.export` (one
process, on this machine), whose single JSON line reaches stdout and whose exit code becomes meshrun's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from training.contract.config import Config
from training.contract.exit_codes import EXIT_INVALID, EXIT_OK


def run_export(cfg: Config, run_dir: str) -> dict[str, Any]:
    e = cfg.export
    if not e.output:
        print("meshrun: action=export needs export.output=DIR, the Hugging Face directory to write", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    if not os.path.isdir(run_dir):
        print(f"meshrun: run.dir={run_dir} does not exist; give the run directory to export", file=sys.stderr)
        raise SystemExit(EXIT_INVALID)
    cmd = [
        sys.executable,
        "-m",
        "training.hf.export",
        run_dir,
        "--output",
        os.path.abspath(e.output),
        "--dtype",
        str(e.dtype),
        "--max-shard-mb",
        repr(float(e.max_shard_mb)),
    ]
    if e.step is not None:
        cmd += ["--step", str(int(e.step))]
    code = subprocess.run(cmd).returncode
    if code != EXIT_OK:
        raise SystemExit(code)
    return {"status": "exported", "output": os.path.abspath(e.output)}
