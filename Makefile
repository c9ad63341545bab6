# shardreplay developer tasks. Everything runs inside .venv (created on first use).
#   make demo    shardreplay train: distributed Ape-X DQN on CartPole, end to end
#   make demo-pixels  shardreplay train on MinAtar Breakout (pixels, 15 minutes on 2 cores)
#   make test    the test suite (installs redis-server with apt-get if missing), on
#                TEST_WORKERS pytest-xdist workers (TEST_WORKERS=0: in this process),
#                and list the 20 slowest at the end (the suite must stay well inside 30 min)
#   make test-fast  the tests not marked slow: the edit loop (about 95 CPU-seconds in all:
#                about a minute on 2 free cores)
#   make lint    ruff
#   make typecheck  mypy on src/ (settings in pyproject.toml)
#   make bench   replay benchmark: shardreplay vs TorchRL vs cpprb, one JSON line
#                (BENCH_ARGS=--quick for a smoke run; the line is also kept in .bench/)

PYTHON      ?= python3.11
VENV        := .venv
BIN         := $(VENV)/bin
# Pinned: an unpinned torch can pull the multi-GB CUDA build. Override to choose a
# wheel index, e.g. make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP       := $(VENV)/.shardreplay-install
BENCH_STAMP := $(VENV)/.shardreplay-bench
PYTEST_ARGS ?=
# Most tests wait on child processes and sockets, so more workers than cores keep 2 cores
# busy: on 2 quiet cores the whole suite took 13:28 with 4 workers and 12:55 with 6, and
# 11:16 with 6 and the bytecode caches below (make test-fast: 54 s).
# loadgroup keeps the tests of a module that share one expensive launch (xdist_group) on one worker.
TEST_WORKERS ?= 6
XDIST       := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
# Bytecode caches on for the tests and the demo even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE): otherwise every xdist worker rewrites and compiles every test
# module again (4 CPU-s a worker) and every process a test starts compiles the package.
# The install compiles none (pip --no-compile: 48 of its 92 CPU-seconds went to compiling
# every file of every package); a module's bytecode is written when it is first imported,
# and before the workers start the tests import the heaviest once (tests/support/warm.py).
WITH_PYC    := env -u PYTHONDONTWRITEBYTECODE
PYTEST      := $(WITH_PYC) $(BIN)/python -m pytest
PIP_INSTALL := $(BIN)/python -m pip install --no-compile
# Everything but torch goes in with uv: it resolves and installs the ~75 packages of the
# test extra in 7 s where pip took 47 s of one core (the whole machine idles meanwhile).
# torch stays pinned (uv keeps the installed CPU wheel, and fails rather than fetch another);
# pip does the same work where uv cannot be had or fails (no PyPI, say).
UV          := $(BIN)/uv
COMMA       := ,
install_rest = ($(PIP_INSTALL) -q uv \
	  && $(UV) pip install --python $(BIN)/python -e ".[$(1)]" "$(TORCH_SPEC)") \
	  || $(PIP_INSTALL) -e ".[$(1)]"
BENCH_ARGS  ?=
DEMO_ARGS   ?=
SUDO        := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test test-fast demo demo-pixels lint typecheck bench redis-server clean

install: $(STAMP)

# The stamp is newer than pyproject.toml once the install succeeded, so re-runs are quick.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(call install_rest,test)
	touch $@

test: install
	@command -v redis-server >/dev/null 2>&1 || $(MAKE) --no-print-directory redis-server
	$(PYTEST) $(XDIST) --durations=20 $(PYTEST_ARGS)

test-fast: install
	@command -v redis-server >/dev/null 2>&1 || $(MAKE) --no-print-directory redis-server
	$(PYTEST) -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The tests start a real redis-server; Debian's package provides it.
redis-server:
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
	  || ($(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y --no-install-recommends redis-server)
	command -v redis-server

# The main job on its embedded defaults: distributed Ape-X DQN on CartPole-v1, local
# transport, no server to start. DEMO_ARGS adds flags (e.g. DEMO_ARGS="--learners 2").
demo: install
	$(WITH_PYC) $(BIN)/shardreplay train $(DEMO_ARGS)

# Pixels on two cores: MinAtar Breakout (10x10x4 images, the MinAtar network) to a mean return
# of 6 (random: about 0.5) within 15 minutes.
# Its curve and the return it reaches are in benchmarks/train/RESULTS-demo.md; docs/atari.md.
demo-pixels: install
	$(call install_rest,minatar)
	$(WITH_PYC) $(BIN)/shardreplay train --env-id MinAtar/Breakout-v1 --max-minutes 15 --total-env-steps 2000000 \
	  --lr 0.001 --batch-size 64 --target-update-interval 250 --samples-per-insert 16 --min-replay 2000 \
	  --epsilon-warmup-steps 20000 --eval-interval-updates 1000 --eval-episodes 10 --stop-return 6 $(DEMO_ARGS)

lint: install
	$(BIN)/ruff check src tests benchmarks examples

typecheck: install
	$(BIN)/mypy

$(BENCH_STAMP): $(STAMP)
	$(call install_rest,test$(COMMA)bench)
	touch $@

# TorchRL's wheel ships a C++ extension built against another torch; rebuild it from the
# sources the wheel itself ships when it does not load (scratch files under .bench/).
bench: $(BENCH_STAMP)
	@$(BIN)/python -c "import torchrl._torchrl" 2>/dev/null \
	  || benchmarks/replay/build_torchrl_ext.sh $(BIN)/python .bench/torchrl-ext
	$(BIN)/python benchmarks/replay/bench_replay.py --out .bench/bench_replay.json $(BENCH_ARGS)

clean:
	rm -rf .bench build dist .pytest_cache .ruff_cache .mypy_cache
