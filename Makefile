# The two commands a newcomer runs: `make train` and `make test`.
# CPU setup pins torch==2.13.0 (the package itself accepts a range, so GPU users keep their own torch).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# the main job shipped in the package (src/jagg/shapes/main_job.yaml) into runs/default: a stopped run continues, a
# finished one is not trained again (`.venv/bin/jagg train --overwrite` moves it aside and starts over)
train: $(STAMP)
	$(VENV)/bin/jagg train --resume-or-start

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
