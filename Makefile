# Thin aliases. `make test` on a fresh machine creates .venv, installs the project and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Without CUDA, ask for the CPU build by its exact local version: pip takes it from a local wheel folder or from
# an index you name (make install PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"), and fails
# rather than fall back to PyPI's multi-GB CUDA build.
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
TORCH_REQ ?= torch==$(TORCH_VERSION)+cpu
else
TORCH_REQ ?= torch==$(TORCH_VERSION)
endif

.PHONY: install install-train test fuzz train bench docs lint format clean

# The whole stack: what training needs, then the extras and the test, eval and lint tools (`make test`).
install: $(VENV)/.installed

# What training needs, and no more: torch and the package's own dependencies (`make train`, the first command).
install-train: $(VENV)/.installed-train

# torch first, then named again beside the package: nothing pulled later may swap it for a CUDA build.
$(VENV)/.installed-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_REQ)" $(PIP_EXTRA)
	$(BIN)/python -m pip install -q -e . "$(TORCH_REQ)" $(PIP_EXTRA)
	touch $@

$(VENV)/.installed: $(VENV)/.installed-train
	$(BIN)/python -m pip install -q -e ".[dev]" "$(TORCH_REQ)" $(PIP_EXTRA)
	touch $@

test: install
	$(BIN)/python -m pytest -q

# The fuzz tier for as long as asked: make fuzz FUZZ_SECONDS=600 (the default; each input kind gets its share, round
# after round of fresh seeds), or FUZZ_EXAMPLES=500 pairs of examples per input kind; FUZZ_SEED=N repeats a run.
# Each kind's rounds and examples are listed at the end (-rP). `make test` runs its fixed-seed CI budget.
fuzz: install
	HF_HUB_OFFLINE=1 FUZZ_SECONDS="$(or $(FUZZ_SECONDS),$(if $(FUZZ_EXAMPLES),,600))" FUZZ_EXAMPLES="$(FUZZ_EXAMPLES)" \
		FUZZ_SEED="$(FUZZ_SEED)" $(BIN)/python -m pytest -q -rP -p no:cacheprovider tests/test_fuzz.py

# The main job: pretrain the bundled tiny model on CPU (about a minute); prints where the checkpoints went.
train: install-train
	$(BIN)/astrai-fabric seq --config recipes/tiny-seq.yaml

# Each prints a table (docs/performance.md records them); bench/gpu_check.py is run by hand on a CUDA machine.
bench: install
	$(BIN)/python bench/loop_overhead.py
	$(BIN)/python bench/step_overhead.py
	$(BIN)/python bench/optimizer_step.py
	$(BIN)/python bench/data_pipeline.py
	$(BIN)/python bench/checkpoint_io.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/lora_memory.py
	$(BIN)/python bench/qlora_memory.py
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/threads.py

# docs/recipes.md is generated from the option docstrings (tests/test_docs.py checks it is current).
docs: install
	$(BIN)/python -m astrai_fabric.config.reference docs/recipes.md

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info
