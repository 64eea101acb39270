PY := .venv/bin/python
SETUP := .venv/.deltasync-setup

.PHONY: setup demo test reliability containers bench clean

setup: $(SETUP)

$(SETUP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

demo: $(SETUP)  ## the main job on embedded defaults: local-folder bucket, tiny local model, vLLM on CPU
	$(PY) -m trainer_space --local --max-steps 20 --run-dir runs/demo --ui --host 127.0.0.1 --port 7860

# Test files run in parallel, each whole on one worker (its module-scoped servers start once).
# Most tests wait on a server starting; two workers keep both of CI's two cores busy.
TEST_WORKERS ?= 2

test: $(SETUP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

reliability: $(SETUP)  ## faults, load, soak and bad input; prints one table, writes runs/reliability.json
	DELTASYNC_RELIABILITY_JSON=runs/reliability.json $(PY) -m pytest -q -m '' tests/reliability

containers: $(SETUP)  ## each Space's container CMD in a fresh virtualenv installed from its rendered folder
	$(PY) -m pytest -q -m install tests/spaces/test_containers.py

bench: $(SETUP)  ## codec, where the payload's bytes go, the replica's pause and per-version checks inside vLLM, fingerprints, the first version after a start, then the 0.6B-1T scale projection
	$(PY) -m bench.codec
	$(PY) -m bench.payload_bounds
	$(PY) -m bench.apply_vllm
	$(PY) -m bench.verify_cost
	$(PY) -m bench.fingerprint
	$(PY) -m bench.cold_start
	$(PY) -m bench.scale

clean:
	rm -rf runs bench/results .pytest_cache
