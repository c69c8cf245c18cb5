# Both entry points create and use a local virtual environment (.venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest workers (pytest-xdist): the suite waits on fsync and on gloo ranks as much as it computes.
TEST_WORKERS ?= 2

.PHONY: test test-frameworks demo examples bench deep-test reliability clean

$(STAMP): pyproject.toml requirements/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/ci.txt -e '.[test,torch,jax]'
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check globalshard backends tests examples bench spec
	$(VENV)/bin/mypy globalshard backends/globalshard_torch backends/globalshard_jax
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --ignore=tests/frameworks

# The real frameworks as oracles (Megatron-Core, torchtitan, transformers on CPU over gloo; Flax and optax
# against Orbax on 8 CPU devices).
FRAMEWORKS := $(VENV)/.frameworks-installed
$(FRAMEWORKS): $(STAMP) requirements/frameworks.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/ci.txt -c requirements/frameworks.txt \
		megatron-core psutil einops transformers accelerate triton spmd_types tyro torchdata flax optax \
		orbax-checkpoint
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -c requirements/frameworks.txt torchtitan
	touch $@

test-frameworks: $(FRAMEWORKS)
	$(PY) -m pytest -p no:cacheprovider -W ignore::UserWarning tests/frameworks

# The hypothesis properties with many more examples (minutes to hours).
deep-test: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest tests

# The main job: a TP/PP/VPP/DP GPT trained, stopped and resumed on other topologies.
demo: $(STAMP)
	$(PY) examples/gpt_demo.py

# The smaller examples: numpy-only resharding, and a TP=2 -> TP=1 torch resume.
examples: $(STAMP)
	$(PY) examples/numpy_demo.py
	$(PY) examples/torch_resume.py

# The full reliability campaign behind docs/reliability.md (about 25 minutes on 2 cores):
# kills at 50+ points per case, every corruption, racing saves, 100,000 fuzz inputs.
RELIABILITY := build/reliability
reliability: $(STAMP)
	$(PY) bench/pages.py start reliability
	GLOBALSHARD_CRASH_POINTS=50 GLOBALSHARD_RACE_TRIALS=20 GLOBALSHARD_RELIABILITY_REPORT=$(CURDIR)/$(RELIABILITY)/report.json \
		$(PY) -m pytest -q -p no:cacheprovider tests/campaigns/test_crash.py tests/campaigns/test_corruption.py tests/checkpoint/test_trust.py -k "sigkill or damage or racing"
	$(PY) tests/campaigns/fuzz_metadata.py --inputs 100000 > $(RELIABILITY)/fuzz.json
	$(PY) bench/pages.py reliability

$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/ci.txt -e '.[test,torch,jax,bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) bench/pages.py start benchmarks
	$(PY) bench/run.py
	$(PY) bench/zero_memory.py
	$(PY) bench/io_memory.py
	$(PY) bench/compare.py
	$(PY) bench/cold_load.py
	$(PY) bench/shared_reads.py
	$(PY) bench/small_tensors.py
	$(PY) bench/training.py
	$(PY) bench/tiers.py
	$(PY) bench/export_memory.py 2
	$(PY) bench/summary.py
	$(PY) bench/pages.py benchmarks

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis
