# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create .venv with the pinned CPU build of torch first; nothing else is needed beforehand.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: setup system-deps demo test lint bench clean

# Debian packages the tests need, each installed only when missing: chromium for the browser
# tests (Playwright drives Debian's chromium; it never downloads a browser), openssh-server for
# the SSH test hosts in network namespaces (tests/hosts.py; no system sshd is started).
system-deps:
	@command -v chromium >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-liberation; }
	@test -x /usr/sbin/sshd || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server; }

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) scripts/run_notebook.py notebooks/01_quickstart.ipynb

lint: setup
	$(PY) -m ruff check skyward_jupyter tests bench scripts
	$(PY) -m ruff format --check skyward_jupyter tests bench scripts
	$(PY) -m mypy

test: lint system-deps
	$(PY) -m pytest

bench: setup
	$(PY) bench/bench_core.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_magics.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_log.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_ssh.py --markdown-out BENCHMARKS.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
