"""How `python -m training.hf.export` and `python -m training.hf.generate` end: one JSON line and exit 0; a
user's error (bad checkpoint, model not convertible, tokenizer missing) as one `error:` line and exit 2; a
bug as its traceback and exit 1 (training/contract/exit_codes.py: the launcher turns each into its message)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from training.contract.exit_codes import EXIT_FAILED, EXIT_INVALID, EXIT_OK


def print_result(action: Callable[[], dict[str, Any]]) -> int:
    """Run the action; print its result or its error; return the exit code."""
    from training.checkpoint.storage import CheckpointError
    from training.contract.tokenizer import TokenizerError
    from training.hf.hf_config import HFError

    try:
        result = action()
    except (HFError, CheckpointError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception:  # noqa: BLE001 - a bug: the traceback, and the failure code
        import traceback

        traceback.print_exc()
        return EXIT_FAILED
    print(json.dumps(result))
    return EXIT_OK
