"""`python -m training.rehearse RUN_DIR [--ranks R,R,..] [--workers N]`: rehearse the run directory's config
(config.json, as `meshrun action=rehearse` wrote it) and write RUN_DIR/rehearsal.json (training/rehearse/main.py)."""

import sys

from training.rehearse.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
