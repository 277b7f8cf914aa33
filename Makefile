# labkit — the two commands: `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test test-fast demo bench gpu-check notebooks install clean

# Create the virtual environment and install labkit with its lab and test extras.
# torch is pinned to 2.13.0 in pyproject.toml (see README: the CPU wheel).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[lab,test]"
	touch $(STAMP)

install: $(STAMP)

# JupyterLab on the project folder (notebooks/ opens first, runs/ is reachable); its
# terminals have .venv/bin on PATH; opening a tracked notebook leaves git clean
# (labkit/lab.py). In your own shell: `source .venv/bin/activate` puts labkit on PATH.
lab: $(STAMP)
	$(BIN)/labkit lab

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --nbval

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" --nbval

demo: $(STAMP)
	$(BIN)/labkit replay --trace data/traces/agentx_small.jsonl.gz \
		--model deepseek-v3 --layout dep16 --hardware h200 \
		--concurrency 6 --duration-s 900 --router session_sticky \
		--num-speculative-tokens 3 --acceptance-length 2.99 --max-model-len 1048576

# CUDA tests, kernels against the HBM roofline, an 8B-sized compute replay beside the
# cost model (labkit/gpu_check.py); without CUDA it says so and exits 0
gpu-check: $(STAMP)
	$(BIN)/python -m labkit.gpu_check

bench: $(STAMP)
	$(BIN)/labkit bench sim
	$(BIN)/labkit bench costmodel
	$(BIN)/labkit bench layouts --quick
	$(BIN)/labkit bench compute --quick
	$(BIN)/labkit bench kv --quick
	$(BIN)/labkit bench traces --quick
	$(BIN)/labkit bench kernels --quick

# Re-execute every notebook in place (after a change that moves their numbers).
notebooks: $(STAMP)
	for nb in notebooks/*.ipynb notebooks/tutorials/*.ipynb notebooks/experiments/*.ipynb \
			notebooks/validation/*.ipynb; do \
		(cd $$(dirname $$nb) && $(CURDIR)/$(BIN)/jupyter nbconvert --to notebook --execute \
			--inplace --ExecutePreprocessor.store_widget_state=False $$(basename $$nb)) || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
