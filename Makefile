# make run: install, then train the embedded default (tiny GPT, tp=2 sp, dp=2 zero=1, CPU processes).
# make test: install, start the dev Slurm cluster, run the tests: the Slurm tests in one pytest process, one after
#   another (the three dev nodes are theirs alone), and meanwhile every other test on TEST_WORKERS pytest-xdist
#   workers (the Slurm tests mostly wait on the scheduler), a test file's tests on one worker (--dist loadfile: a
#   module's shared run happens once), files in collection order (--no-loadscope-reorder: tests/conftest.py
#   collects the longest first). Timing goals are benchmarks (make bench), not tests.
# make check: the fast inner loop: lint, then every test that needs no cluster and no multi-process run (tests/conftest.py).
# make lint: ruff's lint, ruff's format check and mypy (settings in pyproject.toml); make format fixes what it can.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshrun-installed
TEST_WORKERS ?= 2

.PHONY: install bytecode run test check lint format plan keys-doc bench slurm-up slurm-down browser clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 unless the venv has a torch already (a system torch is not visible: no system site
	# packages). From the public index on Linux that pin is the CUDA build (several GB); CPU machines point pip
	# at the CPU wheels first (PIP_INDEX_URL). A GPU machine with CUDA torch preinstalled and no package index:
	# bash bench/gpu_check.sh --install-wheels DIR (bench/gpu_venv.sh; DIR from bench/gpu_wheels.sh) instead.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The project's own sources byte-compiled once (pip does the same for the packages it installs): a shell that sets
# PYTHONDONTWRITEBYTECODE (as some CI images do) otherwise makes every launcher, agent and rank process compile
# launcher/ and training/ from source again (docs/PERFORMANCE.md, "Test suite"). Only changed files are redone.
bytecode: install
	$(PY) -m compileall -q launcher training hydra_plugins bench tests >/dev/null

# The default corpus, prepared once into data/ (meshrun action=prepare): 8 MB of the Python standard library's
# sources, a byte-level BPE of 2048 tokens trained on them, 5 % of the files held out for the validation loss.
DATA ?= data/stdlib

$(DATA).json: | $(STAMP)
	$(VENV)/bin/meshrun action=prepare prepare.output=$(DATA) prepare.tokenizer=bpe prepare.vocab_size=2048 \
		prepare.max_bytes=8000000 prepare.valid_fraction=0.05

run: install bytecode $(DATA).json
	$(VENV)/bin/meshrun data=indexed data.prefixes=[$(DATA)] train.eval_every=20

plan: install
	$(VENV)/bin/meshrun action=plan

# docs/KEYS.md: every key of the schema with its type, default and docstring (launcher/cli/keys_doc.py); run it
# after adding or changing a key or a preset (tests/launcher/cli/test_keys_doc.py fails while it is stale).
keys-doc: install
	$(PY) -m launcher.cli.keys_doc

# One intra-op thread in the test processes themselves: the workers, the Slurm tests' ranks and the spawned ranks
# share the cores already (the launchers set each rank's own count); a second OpenMP thread per process only
# waits at barriers for a core another process holds. --durations: where the time went, in every run's log.
test: export OMP_NUM_THREADS = 1
test: install bytecode lint slurm-up browser
	$(PY) -m pytest -q -m slurm --durations=15 tests > .slurm-tests.log 2>&1 & slurm=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 -m "not slurm" tests; rc=$$?; \
	wait $$slurm; src=$$?; echo "== the Slurm tests (one process, one after another):"; cat .slurm-tests.log; \
	rm -f .slurm-tests.log; [ $$rc -eq 0 ] && [ $$src -eq 0 ]

check: export OMP_NUM_THREADS = 1
check: install bytecode lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slurm and not slow" tests

lint: install
	$(PY) -m ruff check launcher training hydra_plugins bench tests
	$(PY) -m ruff format --check launcher training hydra_plugins bench tests
	$(PY) -m mypy

# Rewrites what `make lint` checks mechanically: ruff's fixable lint findings, then ruff's format.
format: install
	$(PY) -m ruff check --fix launcher training hydra_plugins bench tests
	$(PY) -m ruff format launcher training hydra_plugins bench tests

# Exit 77: the cluster cannot run here (no root / no apt-get); it said why, and the Slurm tests skip with that reason.
slurm-up:
	bash slurm/dev-cluster.sh up || [ $$? -eq 77 ]

# Debian's chromium for tests/launcher/manage/test_report.py (report.html in a headless browser); exit 77: it cannot be installed
# here (no root / no apt-get), it said why, and that test skips with the reason.
browser:
	bash tests/browser.sh >/dev/null || [ $$? -eq 77 ]

slurm-down:
	bash slurm/dev-cluster.sh down

bench: install
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs multirun outputs data
