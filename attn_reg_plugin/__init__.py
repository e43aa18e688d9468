"""attn_reg_plugin: AD-DROP and AttendOut attention regularizers.

The science lives in :mod:`attn_reg_plugin.core` (plain PyTorch). When fairseq imports this
package as ``--user-dir``, fairseq is already loaded and its parts are registered here.
"""
import sys

from .core.ad_drop import ADDrop, ADDropConfig, ad_drop_epoch  # noqa: F401
from .core.attention import attend  # noqa: F401
from .core.controller import AttentionSite, RegularizationController  # noqa: F401

__version__ = "0.1.0"

if "fairseq" in sys.modules:
    from . import fairseq_plugin  # noqa: F401
