# addnorm: `make serve` and `make test` do all set-up on a fresh clone.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
ARTIFACT  ?= artifacts/default
# The server's ADDNORM_HOST / ADDNORM_PORT / ADDNORM_GRPC_PORT set these too: ADDNORM_PORT=8100 make serve
# and make serve PORT=8100 both serve on 8100.
HOST      ?= $(or $(ADDNORM_HOST),127.0.0.1)
PORT      ?= $(or $(ADDNORM_PORT),8000)
GRPC_PORT ?= $(or $(ADDNORM_GRPC_PORT),8001)
DOCS_PORT ?= 8002
# torch is pinned: on these machines pip takes the CPU build from local disk. Elsewhere, point pip at the
# CPU wheel index so no multi-GB CUDA build is pulled: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH     ?= torch==2.13.0
TORCH_INDEX ?=
PIP_TORCH_FLAGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: serve docs kernels peers test test-fast test-images images matrix fuzz-http export parity lint format bench proto clean help

help:
	@echo "make serve   create .venv, export $(ARTIFACT) if missing, check parity, serve on $(HOST):$(PORT) (gRPC $(GRPC_PORT))"
	@echo "make test    create .venv and run the test suite"
	@echo "make kernels build int8's CPU kernels (model/kernels; make serve and make test do)"
	@echo "make test-fast  the unit lane only (model/ and service/ in process, TEST_WORKERS workers, no fixed port; under a minute)"
	@echo "make images  build the api, ray and export images with podman on a base made from Debian's packages"
	@echo "make test-images  build the images and run them as docker-compose.yml does (tests/test_images.py)"
	@echo "make matrix  every variant x attention x depth x placement x norm combination (tests/export/test_matrix.py)"
	@echo "make fuzz-http  every boofuzz request-line and header case of every endpoint (tests/test_http_fuzz.py; hours)"
	@echo "make export  (re-)export the default artifact into $(ARTIFACT)"
	@echo "make parity  re-check $(ARTIFACT) and write a report into $(ARTIFACT)/report"
	@echo "make bench   run the benchmarks (bench/) and the cost curve, write bench/results and docs/benchmarks.md"
	@echo "make peers   the bench's peers (Infinity, sentence-transformers' ONNX backend) in .peers, for bench --text"
	@echo "make lint    ruff check + format check, and the docs site built with mkdocs --strict"
	@echo "make docs    the guides in docs/ as a site on $(HOST):$(DOCS_PORT) (installs mkdocs into .venv)"
	@echo "make proto   regenerate service/protocols/v2/inference_pb2.py from inference.proto (grpcio-tools)"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip

# Two installs: serving and exporting the default model (make serve, export, parity: the export extra, torch's CPU
# build), and everything the tests and benchmarks use (make test, lint, bench: + dev, ray, otel). The second
# includes the first.
$(VENV)/.installed-serve: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -qq $(PIP_TORCH_FLAGS) "$(TORCH)"
	$(BIN)/pip install -qq $(PIP_TORCH_FLAGS) -e ".[export]"
	@touch $@

$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -qq $(PIP_TORCH_FLAGS) "$(TORCH)"
	$(BIN)/pip install -q $(PIP_TORCH_FLAGS) -e ".[export,dev,ray,otel]"
	@touch $@ $(VENV)/.installed-serve

$(ARTIFACT)/manifest.json: | $(VENV)/.installed-serve
	$(BIN)/addnorm-export --artifact $(ARTIFACT)

# int8's kernel library (model/kernels): the server registers it where it is built, and int8 models run on
# onnxruntime's standard operators where it is not (no g++, or no way to fetch onnxruntime's header).
# Built once with the install (onnxruntime's pinned header is fetched then, from Debian's archive, and kept in
# ~/.cache/addnorm): a later make serve fetches nothing.
$(VENV)/.kernels: $(VENV)/.installed-serve model/kernels/int8.cc
	@$(BIN)/python -m addnorm.model.kernels || echo "warning: int8's kernels not built; int8 models will run on onnxruntime's standard operators"
	@touch $@

kernels: $(VENV)/.kernels

# The export already compared every Add & Norm step; before serving, the final output's gate is enough.
# The guides as a site, beside make serve (its own port): mkdocs alone is installed for it.
$(VENV)/.installed-docs: | $(BIN)/python
	$(BIN)/pip install -qq "mkdocs>=1.6,<2"
	@touch $@

docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs serve --dev-addr $(HOST):$(DOCS_PORT)

# The ports are checked first: a taken one is said at once, not after the parity check.
serve: $(VENV)/.installed-serve $(VENV)/.kernels
	@$(BIN)/python -m addnorm.service.cli --check-ports --host $(HOST) --port $(PORT) --grpc-port $(GRPC_PORT)
	@$(MAKE) --no-print-directory $(ARTIFACT)/manifest.json
	$(BIN)/addnorm-parity --artifact $(ARTIFACT) --no-steps
	$(BIN)/addnorm-serve --artifact $(ARTIFACT) --host $(HOST) --port $(PORT) --grpc-port $(GRPC_PORT)

export: $(VENV)/.installed-serve
	$(BIN)/addnorm-export --artifact $(ARTIFACT)

parity: $(VENV)/.installed-serve $(ARTIFACT)/manifest.json
	$(BIN)/addnorm-parity --artifact $(ARTIFACT) --report $(ARTIFACT)/report

# pytest exits 5 when it collects no test, so an empty run fails here too. TEST_WORKERS processes (pytest-xdist)
# take whole test files (each file's fixtures export and start servers once), the longest first (tests/conftest.py,
# LONGEST_FIRST); 0 runs in this process. One more worker than a 2-core machine's cores: two left 14% of the cores
# idle (tests waiting on servers, clusters, sockets); three took 1,047 s against two's 1,216 s (2-core EPYC
# avx2 avx512f avx512_vnni, 2026-12-03, the same tree). Four took 943 s against three's 880 and 930 in the same hour,
# their CPU 1,708 s against 1,593-1,671 (2-core Xeon avx2 avx512f avx512bw avx512_vnni, 2026-12-06): three keep
# the cores busy (each worker 96-99% of the run in a test), a fourth only adds contention.
TEST_WORKERS ?= 3
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -m unit -q -n $(TEST_WORKERS) --dist loadfile

# podman, on a base image made from Debian's packages (deploy/docker/base-image.sh): no image registry needed.
images:
	deploy/docker/images.sh

# The images built and run hardened, as docker-compose.yml runs them; needs podman and debootstrap, as root.
test-images: $(VENV)/.installed
	$(BIN)/python -m pytest -m images tests/test_images.py -s

# The whole combination matrix (make test runs a representative subset of it); about 35 minutes on 2 cores. Its
# module fixture exports every combination before the first test, past pytest-timeout's 600 s: no timeout here.
matrix: $(VENV)/.installed
	ADDNORM_MATRIX=full $(BIN)/python -m pytest tests/export/test_matrix.py -rA --timeout 0

# Every boofuzz case of every endpoint (make test sends a seeded sample of 12 each): about 121,000 cases, 2-3 hours
# on 2 cores. ADDNORM_HTTP_FUZZ_SEED picks make test's sample.
fuzz-http: $(VENV)/.installed
	ADDNORM_HTTP_FUZZ_CASES=0 $(BIN)/python -m pytest tests/test_http_fuzz.py -s -rA --timeout 0

bench: $(VENV)/.installed
	$(BIN)/python -m bench
	$(BIN)/python -m bench --cost-curve

# The bench's peers at their CPU best (python -m bench --text, --rerank): Infinity (torch and optimum engines) and
# sentence-transformers' ONNX backend, in an environment of their own: Infinity 0.0.78 pins sentence-transformers
# < 4 and numpy < 2, which the dev extra is past. torch pinned as above (its CPU build).
PEERS ?= .peers
peers: $(PEERS)/.installed

$(PEERS)/.installed:
	$(PY) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -qq --upgrade pip
	$(PEERS)/bin/pip install -qq $(PIP_TORCH_FLAGS) "$(TORCH)" "infinity-emb[server,torch,optimum]==0.0.78"
	touch $@

# grpcio-tools < 1.77 writes protobuf 6.31 code, which the dependency floor (protobuf >= 6.31.1) runs.
proto: $(VENV)/.installed
	$(BIN)/pip install -q "grpcio-tools<1.77"
	cd service/protocols/v2 && ../../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. inference.proto

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mkdocs build --strict --quiet

format: $(VENV)/.installed
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) artifacts .pytest_cache .ruff_cache build *.egg-info
