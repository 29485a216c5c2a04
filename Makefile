# ucm-connector: make test sets up everything it needs on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: test venv redis-server bench run clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip >/dev/null 2>&1 || true
	$(PIP) install -q -e '.[test]'
	touch $@

# Debian's redis-server (7.x) when the machine has none.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server from Debian's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null

test: venv redis-server
	$(PY) -m pytest -q tests

# A store demo until the connector lands: one store, a few blocks, its stats.
run: venv
	$(VENV)/bin/ucm-bench --store "disk://$(CURDIR)/.cache/demo-store?capacity=1GiB" --block-kib 1024 --blocks 256

bench: venv redis-server
	$(PY) benchmarks/store_bench.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
