# Everything a fresh machine needs: `make test` and `make demo` bootstrap the virtual environment,
# the CPU build of torch that lies on the machine, and the FFmpeg libraries torchcodec loads.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DATASET ?= droid
OUT ?= shards/$(DATASET)
SAMPLE ?= sample_data
PYTEST_ARGS ?=

ARGS ?=

.PHONY: setup test demo sample-data shards check-shards clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: $(STAMP)  ## create .venv with every dependency (idempotent)

$(STAMP): pyproject.toml
	@command -v ffmpeg >/dev/null || { echo "installing FFmpeg (torchcodec loads its libraries)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq ffmpeg >/dev/null; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: $(STAMP)  ## run the test suite
	$(PY) -m pytest -q $(PYTEST_ARGS)

sample-data: $(STAMP)  ## write the three sample LeRobot datasets into $(SAMPLE)/
	$(PY) scripts/make_sample_dataset.py --layout droid --out $(SAMPLE)/droid --episodes 4 --seed 0
	$(PY) scripts/make_sample_dataset.py --layout libero --out $(SAMPLE)/libero --episodes 4 --seed 0
	$(PY) scripts/make_sample_dataset.py --layout libero-v3 --out $(SAMPLE)/libero-v3 --episodes 4 --seed 0

demo: sample-data  ## sample data -> read every episode and decode its frames
	$(PY) -m preprocess inspect $(SAMPLE)/droid --decode
	$(PY) -m preprocess inspect $(SAMPLE)/libero --decode
	$(PY) -m preprocess inspect $(SAMPLE)/libero-v3 --decode

shards: $(STAMP)  ## build shards: make shards DATASET={droid,libero,franka_pnp} [SRC=lerobot_root] [OUT=dir] [ARGS="..."]
	$(PY) -m preprocess shards --dataset $(DATASET) --out $(OUT) $(if $(SRC),--src $(SRC)) $(ARGS)

check-shards: $(STAMP)  ## integrity check of a shard directory: make check-shards [OUT=dir]
	$(PY) -m preprocess check $(OUT)

clean:  ## remove the virtual environment and generated data
	rm -rf $(VENV) $(SAMPLE)
