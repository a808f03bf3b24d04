# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create .venv with the pinned CPU build of torch first; nothing else is needed beforehand.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

# The lab's "Sky" side panel, built from labextension/ with npm into the package.
LABEXT := skyward_jupyter/labextension/static/style.js
LABSRC := $(wildcard labextension/src/*.ts labextension/style/*) \
          labextension/package.json labextension/tsconfig.json
NPMDEP := labextension/node_modules/.package-lock.json
SHARE  := $(VENV)/share/jupyter

.PHONY: setup system-deps demo test lint labextension vendor-uplot bench pictures clean

# Debian packages the tests need, each installed only when missing: chromium for the browser
# tests (Playwright drives Debian's chromium; it never downloads a browser), openssh-server for
# the SSH test hosts in network namespaces (tests/hosts.py; no system sshd is started), Slurm and
# munge for the test cluster (tests/slurm_cluster.py runs its own daemons on files in a test's
# tmp). Their services are neither started (a policy-rc.d that says no, unless one is there
# already) nor enabled (their postinst enables them; disabled again right after).
SLURM_DEPS := /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/sbatch /usr/bin/srun
POLICY_RC  := /usr/sbin/policy-rc.d
system-deps:
	@command -v chromium >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-liberation; }
	@test -x /usr/sbin/sshd || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server; }
	@for f in $(SLURM_DEPS); do test -x $$f || missing=1; done; \
	if [ -n "$$missing" ]; then \
		apt-get update -q || exit 1; \
		ours=; if [ ! -e $(POLICY_RC) ]; then \
			printf '#!/bin/sh\nexit 101\n' >$(POLICY_RC) && chmod 755 $(POLICY_RC) && ours=1; fi; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge; \
		rc=$$?; if [ -n "$$ours" ]; then rm -f $(POLICY_RC); fi; \
		[ $$rc -eq 0 ] || exit $$rc; \
		! command -v systemctl >/dev/null || \
			systemctl disable --quiet munge.service slurmd.service slurmctld.service; \
	fi

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q $(TORCH)
	SKIP_JUPYTER_BUILDER=1 $(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# `npm install` with the lock file rather than `npm ci`: the lock records only this platform's
# optional rspack binaries (the registry here has not all of the others), which `npm ci` refuses.
$(NPMDEP): labextension/package-lock.json
	cd labextension && npm install --no-audit --no-fund --no-save

# The venv's Jupyter gets the side panel as a link to the build (the editable install copied
# only what existed then: install.json) and the server extension's enabling config, as a wheel
# install would.
$(LABEXT): $(LABSRC) $(NPMDEP) $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" npm --prefix labextension run build
	mkdir -p $(SHARE)/labextensions $(VENV)/etc/jupyter/jupyter_server_config.d
	rm -rf $(SHARE)/labextensions/skyward-jupyter
	ln -s $(CURDIR)/skyward_jupyter/labextension $(SHARE)/labextensions/skyward-jupyter
	cp jupyter-config/jupyter_server_config.d/skyward_jupyter.json \
		$(VENV)/etc/jupyter/jupyter_server_config.d/
	touch $@

labextension: $(LABEXT)

# The panel's charts draw with uPlot, vendored in the package (charts must draw without
# internet): copied again from the npm package that labextension/package.json pins.
UPLOT_DIST := labextension/node_modules/uplot/dist
vendor-uplot: $(NPMDEP)
	cp $(UPLOT_DIST)/uPlot.iife.min.js $(UPLOT_DIST)/uPlot.min.css skyward_jupyter/display/static/
	cp labextension/node_modules/uplot/LICENSE skyward_jupyter/display/static/uPlot.LICENSE

setup: $(STAMP) $(LABEXT)

demo: setup
	$(PY) scripts/run_notebook.py notebooks/01_quickstart.ipynb

lint: setup
	$(PY) -m ruff check skyward_jupyter tests bench scripts
	$(PY) -m ruff format --check skyward_jupyter tests bench scripts
	$(PY) -m mypy

test: lint system-deps
	npm --prefix labextension test
	PY=$(PY) scripts/run_tests.sh

# The README's pictures (docs/*.png), taken by the browser tests that check what they show.
pictures: setup
	SKYWARD_PICTURES=docs $(PY) -m pytest -q tests/test_browser.py tests/test_browser_charts.py tests/test_lab_panel.py

bench: setup
	$(PY) bench/bench_core.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_magics.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_log.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_ssh.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_byo.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_transfer.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_fanout.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_cell.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_scale.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_secure.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_packages.py --markdown-out BENCHMARKS.md
	$(PY) bench/bench_gpu.py --markdown-out BENCHMARKS.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache skyward_jupyter/labextension
	rm -rf labextension/node_modules labextension/lib labextension/build-test
