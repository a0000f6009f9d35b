# cotserve: the two set-up commands are `make up` and `make test` (see README.md).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-dev up test fuzz browser protos lint-protos envoy-descriptor readme demo-model testbed-model wasm-modules clean

# Strict editable mode: `cotserve` is a tree of links (build/__editable__.*) that editors and tools can follow
# without setuptools' import hooks; a new module appears there at the next `make install` (or `make test`).
EDITABLE := --config-settings editable_mode=strict

# Keep an installed torch; otherwise take 2.13.0 (on the project's CPU machines pip finds the
# CPU build on disk). The project's own bound (torch>=2.4) is then already satisfied.

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -q -e ".[all]" $(EDITABLE)

install-dev:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -q -e ".[all,dev]" $(EDITABLE)

## Start the whole stack on the embedded defaults (bundled demo model), Ctrl-C to stop.
up: install
	$(PYTHON) -m cotserve.cli up

## Install with the dev extra (and Debian's chromium for the heatmap page's test), run the whole test suite.
test: install-dev browser
	$(PYTHON) -m pytest -q

## The property-based tests of untrusted input, longer and with a fresh seed (the suite runs them bounded and repeatable).
fuzz: install-dev
	COTSERVE_FUZZ_EXAMPLES=$${COTSERVE_FUZZ_EXAMPLES:-5000} $(PYTHON) -m pytest -q tests/gateway/test_fuzz.py \
		tests/gateway/test_openapi_fuzz.py tests/gateway/test_parser_fuzz.py tests/gateway/test_grpc_fuzz.py

# Headless Chromium for tests/telemetry/test_page.py: Debian's package, installed when missing and
# we are root; otherwise that test is skipped (CI sets COTSERVE_REQUIRE_BROWSER=1 to make it fail).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser test ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is not installed and apt-get needs root: the browser test will be skipped"; fi; }

## Regenerate services/<service>/v1/ from protos/ (a test fails when they drift apart).
protos:
	$(PYTHON) -m cotserve.common.protogen

lint-protos:
	cd protos && buf lint

## The gateway API's descriptor set for Envoy's gRPC-JSON transcoder (a test fails when it is stale).
envoy-descriptor:
	cd protos && buf build --path cotserve/gateway --as-file-descriptor-set --exclude-source-info -o ../deploy/envoy/gateway.binpb

## Remake README.md's command table from the command line's own definitions (a test fails when it is stale).
readme:
	$(PYTHON) -c "import pathlib, cotserve.cli as c; p = pathlib.Path('README.md'); p.write_text(c.readme_with_commands(p.read_text()))"

## Retrain the bundled demo model (about 15 minutes on 2 CPU cores).
demo-model:
	$(PYTHON) -m cotserve.demo.train --out services/worker/demo/cotserve-demo

## Retrain the reasoning testbed from the demo model (about 12 minutes on 2 CPU cores).
testbed-model:
	$(PYTHON) -m cotserve.demo.train --task testbed --out services/worker/demo/testbed

## Rebuild the shipped WASI modules (needs Debian's clang, lld, wasi-libc, libclang-rt-dev-wasm32).
wasm-modules:
	services/sandbox/modules/build.sh

clean:
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
