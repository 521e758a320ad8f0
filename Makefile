# Everything a fresh machine needs: `make test` and `make demo` bootstrap the virtual environment,
# the CPU build of torch that lies on the machine, and the FFmpeg libraries torchcodec loads.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# the wheel index torch comes from: empty = pip's configured index (the CPU build here); a CUDA build, e.g.
# make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128 (docs/CLUSTER.md)
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DATASET ?= droid
OUT ?= shards/$(DATASET)
SAMPLE ?= sample_data
# `make demo-data`: a sample LeRobot dataset of $(DATASET) and tiny random-init encoders to try the farm on
SAMPLE_SRC := build/sample/$(DATASET)
TINY := build/tiny_checkpoints
TINY_WEIGHTS := --vae $(TINY)/wan2.2/Wan2.2_VAE.pth --text-encoder $(TINY)/umt5/models_t5_umt5-xxl-enc-bf16.pth \
  --tokenizer $(TINY)/umt5/tokenizer --image-encoder $(TINY)/clip/models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth
PYTEST_ARGS ?=
# one pytest process per core (pytest-xdist), at most 4; each test file runs whole in one of them, so a module's
# fixtures are built once; TEST_PROCESSES=0 runs the suite in this process
TEST_PROCESSES ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_PROCESSES) --maxprocesses 4 --dist loadfile
PRESET ?= tiny
NPROC ?= 2

ARGS ?=

.PHONY: setup lint test test-unit test-e2e demo demo-data sample-data shards check-shards train clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: $(STAMP)  ## create .venv with every dependency (idempotent)

$(STAMP): pyproject.toml
	@command -v ffmpeg >/dev/null || { echo "installing FFmpeg (torchcodec loads its libraries)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq ffmpeg >/dev/null; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: $(STAMP)  ## the whole check, quickest first: lint, then the unit tests, then the end-to-end tests
	$(MAKE) --no-print-directory lint
	$(PYTEST) tests/unit $(PYTEST_ARGS)
	$(PYTEST) tests/e2e $(PYTEST_ARGS)

lint: $(STAMP)  ## ruff (pyflakes' errors and pycodestyle's, lines of at most 120 characters; its formatter's style), then pyright's basic checks
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .
	$(VENV)/bin/pyright

test-unit: $(STAMP)  ## the unit tests alone: the code called in the test process, no process started (minutes)
	$(PYTEST) tests/unit $(PYTEST_ARGS)

test-e2e: $(STAMP)  ## the end-to-end tests alone: the tools in processes of their own (CLI, torchrun, builds, S3, Ray)
	$(PYTEST) tests/e2e $(PYTEST_ARGS)

sample-data: $(STAMP)  ## write the three sample LeRobot datasets into $(SAMPLE)/
	$(PY) scripts/make_sample_dataset.py --layout droid --out $(SAMPLE)/droid --episodes 4 --seed 0
	$(PY) scripts/make_sample_dataset.py --layout libero --out $(SAMPLE)/libero --episodes 4 --seed 0
	$(PY) scripts/make_sample_dataset.py --layout libero-v3 --out $(SAMPLE)/libero-v3 --episodes 4 --seed 0

demo: $(STAMP)  ## sample DROID + LIBERO datasets -> shards with a held-out episode (tiny encoders) -> integrity checks -> a decoded preview -> 2-process CPU training on their weighted mixture from a tiny official base, with validation loss and open-loop action error -> eval-ready export + curves
	$(MAKE) --no-print-directory demo-data DATASET=droid && $(PY) -m preprocess shards --dataset droid --src build/sample/droid $(TINY_WEIGHTS) --out build/demo/droid --anchor-stride 4 --samples-per-shard 16 --val-episodes 5
	$(MAKE) --no-print-directory demo-data DATASET=libero && $(PY) -m preprocess shards --dataset libero --src build/sample/libero $(TINY_WEIGHTS) --out build/demo/libero --anchor-stride 4 --samples-per-shard 16 --val-episodes 5
	$(PY) -m preprocess check build/demo/droid
	$(PY) -m preprocess check build/demo/libero
	$(PY) -m preprocess preview build/demo/droid --vae $(TINY)/wan2.2/Wan2.2_VAE.pth --samples 1 --out build/demo/preview --src build/sample/droid
	$(PY) scripts/make_tiny_base.py --out build/demo/base --shards build/demo/droid --also libero_sim
	rm -rf build/demo/run
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --standalone --nproc-per-node=2 train/main.py --preset tiny \
	  --data.mixture build/demo/droid=0.7 build/demo/libero=0.3 --checkpoint.dir build/demo/run --steps 30 \
	  --metrics.interval 5 --metrics.val-interval 10 --metrics.action-interval 10 --metrics.action-samples 4 \
	  --metrics.action-shards build/demo/droid/val build/demo/libero/val \
	  --model.init-from build/demo/base --checkpoint.export-base build/demo/base
	$(PY) scripts/plot_metrics.py build/demo/run

demo-data: $(STAMP)  ## sample LeRobot dataset build/sample/$(DATASET) (6 episodes) and tiny encoders build/tiny_checkpoints (once)
	test -f $(SAMPLE_SRC)/meta/info.json || $(PY) scripts/make_sample_dataset.py --out $(SAMPLE_SRC) --episodes 6 --seed 0 \
	  --layout $$($(PY) -c "from wampipe import configs; print(configs.read(configs.DATASETS_FILE)['$(DATASET)']['sample_layout'])")
	test -f $(TINY)/README.json || $(PY) scripts/make_tiny_checkpoints.py --out $(TINY)

shards: $(STAMP)  ## build shards: make shards DATASET={droid,libero,franka_pnp} [SRC=lerobot_root ARGS="--vae ... "] [OUT=dir]; no SRC: demo-data
	$(if $(SRC),,$(MAKE) --no-print-directory demo-data DATASET=$(DATASET))
	$(PY) -m preprocess shards --dataset $(DATASET) --out $(OUT) --src $(or $(SRC),$(SAMPLE_SRC)) $(if $(SRC),,$(TINY_WEIGHTS)) $(ARGS)

train: $(STAMP)  ## train: make train PRESET={tiny,libero-5b,droid-5b,droid-14b} OUT=shard_dir [NPROC=n] [ARGS="..."]
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) train/main.py --preset $(PRESET) --data.shards $(OUT) $(ARGS)

check-shards: $(STAMP)  ## integrity check of a shard directory: make check-shards [OUT=dir]
	$(PY) -m preprocess check $(OUT)

clean:  ## remove the virtual environment and generated data
	rm -rf $(VENV) $(SAMPLE) build
