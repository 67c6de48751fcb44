# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-quick lint venv clean

$(STAMP):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,data,hf]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)  ## the project's virtual environment alone (CI builds it beside the extras)

demo: $(STAMP)  ## the main job: a local swarm on the embedded corpus that visibly learns
	$(VENV)/bin/node demo

test: $(STAMP) lint  ## everything CI runs: lint, unit, integration, real processes, netns hosts
	@# the long one-process simulations two at a time (they open no sockets and time nothing);
	@# then everything else one test at a time, as real processes need the machine to themselves
	$(PY) -m pytest -ra -m inprocess -n 2 --dist loadfile --durations=10; sims=$$?; \
	$(PY) -m pytest -ra -m "not inprocess" --durations=25; rest=$$?; \
	exit $$(( sims || rest ))

test-quick: $(STAMP)  ## the fast loop: skips real-process and multi-host tests
	$(PY) -m pytest -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict protocol swarm
	$(VENV)/bin/mypy node bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
