# Every target builds .venv itself on a fresh machine: `make demo` and `make test` are all
# the set-up there is.
PYTHON ?= python3

# Where PYTHONDONTWRITEBYTECODE is set (this machine sets it), pytest re-rewrote every test
# module in each of its workers (collection took 20 s of CPU a worker, 13 s with the
# caches), and every fresh interpreter the tests start (tools, CLI and crash subprocesses)
# compiled ckptstore again: importing it took 3.6 s against 3.0 (measured here,
# 2026-11-28). The caches go in __pycache__ directories, which .gitignore leaves out.
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test test-cpu lint typecheck unit docs demo demo-fsdp bench bench-ab crashtest crashtest-sharded reshard-fuzz meta-fuzz scale-real scale-real-tp scale-sim scale-sim-tp clean

venv: $(STAMP)

# torch first and pinned: on this machine a CPU build of 2.13 lies on disk, while a bare
# `torch` (or an unpinned range pulled in by a dependency) would fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.*"
	$(BIN)/pip install -q -e ".[dev]"
	# torchtitan's checkpointer (tests/test_torchtitan.py) without its training stack: its
	# wheel requires wandb, tensorboard, datasets, torchdata, none of which that part imports.
	$(BIN)/pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check ckptstore tests tools
	$(BIN)/ruff format --check ckptstore tests tools

typecheck: $(STAMP)
	$(BIN)/mypy

# Four workers on the CI machine's 2 cores: much of the suite waits on processes, fsync and
# timeouts, not on the CPU. Measured here on 2 cores (2026-11-26, the same tree): -n 2 ran
# 623 s, -n 3 546 s (16.8 CPU minutes: 1.83 cores busy on average). Again on 2026-11-30
# (74da9af, fresh clones, `time make test`): -n 3 ran pytest in 619 s (make test 10:27),
# -n 4 in 545 s (9:10), the suite's new tests waiting on real timeouts and signals.
# worksteal keeps the long multi-rank tests from ending on one worker. PYTEST_ARGS="-n 0"
# runs it in one process.
PYTEST_ARGS ?= -n 4 --dist worksteal
unit: $(STAMP)
	$(BIN)/python -m pytest -q -x -p no:cacheprovider $(PYTEST_ARGS)

# Where the suite's time goes: every test alone (-n 0, ~20 min), with the CPU it cost (its own
# cgroup where it may make one, else the whole machine: tools/testcpu.py); the heaviest tests and
# files are printed at the end.
test-cpu: $(STAMP)
	PYTHONPATH=tools $(BIN)/python -m pytest -q -p no:cacheprovider -n 0 -p testcpu $(TESTCPU_ARGS)

# The docs build is part of the test: a broken link or a page missing from the nav fails it.
# The checks run beside the tests, not before them: ruff, mypy and mkdocs (~40 s, one core)
# fill the CPU pytest's workers leave idle while they wait on processes, fsync and timeouts.
# Their output comes as it is made (no --output-sync, which held pytest's until its end);
# any failure fails the target.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j4 lint typecheck docs unit

# README.md, CONTRIBUTING.md and docs/ as a site in site/ (mkdocs.yml). --strict turns every
# warning (a link to a missing page or anchor, a page left out of the nav) into a failure;
# never add -q, which hides the warnings from --strict as well.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

# The DDP part (killed mid-save, resumes bit-identically), then the FSDP2 part.
demo: $(STAMP)
	$(BIN)/python tools/demo.py
	$(BIN)/python tools/demo_fsdp.py

# FSDP2 on 2 ranks killed mid-save; resumes on 3 ranks and in 1 process (no process group).
demo-fsdp: $(STAMP)
	$(BIN)/python tools/demo_fsdp.py

# Benchmark vs torch.save, safetensors, DCP and the raw disk; results in bench-out/bench.json.
# e.g. make bench BENCH_ARGS="--size 100MB --plot"; FSDP2 (2 ranks, restore on 1 and 3):
# make bench BENCH_ARGS="--sharded --size 256MB"
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python tools/bench.py $(BENCH_ARGS)

# This tree's ckptstore against commit BASELINE, side by side: the sharded save and restores.
BASELINE ?= HEAD
AB_ARGS ?=
bench-ab: $(STAMP)
	$(BIN)/python tools/bench_ab.py --baseline $(BASELINE) $(AB_ARGS)

# The long crash campaign (make test runs a short one).
CRASH_ARGS ?=
crashtest: $(STAMP)
	$(BIN)/python tools/crashtest.py $(CRASH_ARGS)

# The sharded crash campaign: FSDP2 jobs on 2 and 3 ranks killed in every phase.
SHARDED_CRASH_ARGS ?= --trials 300
crashtest-sharded: $(STAMP)
	$(BIN)/python tools/crash_sharded.py $(SHARDED_CRASH_ARGS)

# Randomized resharding: random DTensors saved on 1-4 ranks, restored on 1-4, every byte checked.
RESHARD_FUZZ_ARGS ?= --trials 1000
reshard-fuzz: $(STAMP)
	$(BIN)/python tools/reshard_fuzz.py $(RESHARD_FUZZ_ARGS)

# Forged metadata of sharded steps: one JSON value changed, the manifest forged to match.
META_FUZZ_ARGS ?= --bases 20 --mutations 200
meta-fuzz: $(STAMP)
	$(BIN)/python tools/meta_fuzz.py $(META_FUZZ_ARGS)

# Sharded coordination with real processes (issue 21): bytes, collectives and CPU per rank
# for 2..16 ranks, beside the ckptstore of SCALE_BASELINE; a plot in docs/.
SCALE_BASELINE ?= 2f0f77c
scale-real: $(STAMP)
	$(BIN)/python tools/scale_real.py --worlds 2 4 8 16 --baseline $(SCALE_BASELINE) \
		--json benchmarks/results/scale_real.json --plot docs/img/scale_real.png

# FSDP2 over TP (TP 2) on 4..16 ranks, beside the last ckptstore that wrote it as format 2.
scale-real-tp: $(STAMP)
	$(BIN)/python tools/scale_real.py --worlds 4 8 16 --tp 2 --baseline 75d5986 \
		--json benchmarks/results/scale_real_tp.json --plot docs/img/scale_real_tp.png

# The same at 64..16,384 ranks, one simulated rank at a time on a fake process group.
scale-sim: $(STAMP)
	$(BIN)/python tools/scale_sim.py --baseline $(SCALE_BASELINE) \
		--json benchmarks/results/scale_sim.json

# FSDP2 over tensor parallelism (TP 8), beside the last ckptstore that wrote it as format 2.
scale-sim-tp: $(STAMP)
	$(BIN)/python tools/scale_sim.py --layout fsdp-tp --fork --baseline 75d5986 \
		--baseline-max 1024 --json benchmarks/results/scale_sim_tp.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info site
