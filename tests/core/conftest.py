"""tests/core's set-up: Triton's interpreter for the fused edit kernel's tests (test_fused_edit.py)
on a machine without CUDA."""

import os
import sys

import torch

# The interpreter must be on when Triton is first imported: it makes triton.language's own jit
# functions (tl.randint among them) interpretable. Collecting this folder imports Triton (through
# torch, from test_checkpointing.py on), so it is set here, before any module of the folder. Without
# CUDA no Triton kernel can be compiled or run, so nothing else changes.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
