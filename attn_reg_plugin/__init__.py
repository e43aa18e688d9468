"""attn_reg_plugin: AD-DROP and AttendOut attention regularizers.

The science lives in :mod:`attn_reg_plugin.core` (plain PyTorch); its docstring is the
four-step guide to porting AD-DROP into your own model, and the names below are that API.
When fairseq imports this package as ``--user-dir``, fairseq is already loaded and its parts
are registered here.
"""

import sys

from .core import (  # noqa: F401
    ATTENTION_KINDS,
    ADDrop,
    ADDropConfig,
    AttentionSite,
    RegularizationController,
    ad_drop_epoch,
    attend,
    bare_module,
    logit_target,
    regression_target,
    token_loss_target,
)

__version__ = "0.2.0"

if "fairseq" in sys.modules:
    from . import fairseq_plugin  # noqa: F401
