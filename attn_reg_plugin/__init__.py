"""attn_reg_plugin: AD-DROP and AttendOut attention regularizers.

Three entry points, one per way in: :mod:`attn_reg_plugin.core` (plain PyTorch; its docstring is
the four-step guide to porting AD-DROP into your own model), :mod:`attn_reg_plugin.hf` (the
Hugging Face trainers) and fairseq's ``--user-dir`` (``attn-reg-user-dir`` prints the folder).
The package itself re-exports nothing, so each name has one import path. When fairseq is
already loaded, its parts are registered on import.
"""

import sys

__version__ = "0.3.0"

if "fairseq" in sys.modules:
    from . import fairseq_plugin  # noqa: F401
