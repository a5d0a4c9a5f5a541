"""`meshrun action=generate run.dir=D generate.prompt_tokens=[...] generate.max_new_tokens=N`: continue a prompt
with D's checkpoint, on one process with a KV cache.

Runs `python -m training.hf.generate` (the launcher never imports torch); its one JSON object reaches stdout
and its exit code becomes meshrun's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from training.contract.config import Config, config_to_dict
from training.contract.exit_codes import EXIT_INVALID, EXIT_OK


def run_generate(cfg: Config, run_dir: str) -> dict[str, Any]:
    if not os.path.isdir(run_dir):
        print(
            f"meshrun: run.dir={run_dir} does not exist; give the run directory whose checkpoint generates",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_INVALID)
    g = cfg.generate
    if g.prompt_file:
        if g.prompt or g.prompt_tokens:
            print(
                "meshrun: give one of generate.prompt_file, generate.prompt and generate.prompt_tokens; nothing was "
                "generated",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_INVALID)
        try:
            with open(g.prompt_file, encoding="utf-8") as f:
                g.prompt = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            print(
                f"meshrun: generate.prompt_file={g.prompt_file!r} cannot be read as UTF-8 text ({exc}); nothing was "
                "generated",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_INVALID) from None
    options = json.dumps(config_to_dict(cfg)["generate"])
    code = subprocess.run([sys.executable, "-m", "training.hf.generate", run_dir, "--options", options]).returncode
    if code != EXIT_OK:
        raise SystemExit(code)
    return {"status": "generated"}
