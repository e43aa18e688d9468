"""Framework-free PyTorch core, on three floors: ``regularizers/`` (each regularizer, their interface and
registry, options and combinations) above ``kernel/`` (one attention call: its plan, rules and masks, the
PyTorch and fused paths) and ``training/`` (checkpointing, collectives, sharding, a model's copy).

This is also the porting API for your own model (no fairseq or transformers needed). Four steps;
``examples/custom_seq2seq/`` is a complete encoder-decoder that follows them:

1. **Register** each attention module once, when the model is built::

       controller = RegularizationController()
       self.site = controller.register("encoder-self", layer)   # or "decoder-self", "encoder-decoder"

2. **Attend** through the core kernel inside the module's forward, after projecting q/k/v
   to (B, H, T, d)::

       out, _ = attend(q, k, v, bias=mask, dropout_p=p if self.training else 0.0, site=self.site)

   ``mask``: bool (True = may attend) or additive float, broadcastable to (B, H, T, S); a causal
   self-attention may pass ``is_causal=True`` (sdpa's flag) instead of the causal mask. With no
   regularizer pass running this is ``F.scaled_dot_product_attention`` and next to nothing else
   (``attend`` checks that first), so the plugin costs an idle model nothing.

3. **Target**: the scalar whose gradient attributes each attention map, as a function
   ``(model output, labels or None) -> (F, labels used)``::

       target = lambda logits, labels: token_loss_target(logits, tgt != pad, labels)   # seq2seq, tagging
       # logit_target(logits, labels) for classifiers; multi_label_target(logits, labels) for multi-label;
       # regression_target(pred, gold) for regression

4. **Wrap** the training forward on the epochs the schedule selects::

       ad_drop = ADDrop(ADDropConfig(p=0.2, q=0.2, attention="encoder-self"), controller)
       if ad_drop_epoch(ad_drop.config.schedule, epoch):            # 1-based; even epochs
           with ad_drop.masked(lambda: model(src, prev), target, frozen=model) as stats:
               loss = criterion(model(src, prev), tgt)              # this forward is masked
           rate = stats["rate"]                                     # dropped / droppable, plain numbers
       else:
           loss = criterion(model(src, prev), tgt)
       loss.backward()

``masked`` runs the attribution pass (no parameter gradients, graph freed) before the block;
only the block's loss is back-propagated. A model that checkpoints activations does it with
``controller.checkpoint(layer, *args)``: the call carries the pass, so a recomputed layer repeats it.
Bad options raise ``ValueError`` naming the option.

The other regularizers take the same controller: ``AttendOut(AttendOutConfig(...), controller, generator)``,
``ScheduledAttentionDropout(ScheduledDropoutConfig(...), controller)``,
``AttentionLayerDrop(AttentionLayerDropConfig(...), controller)``, ``DropHead(DropHeadConfig(...),
controller)`` (docs/PORTING.md). R-Drop needs no
controller, only the model's own dropout (``core/regularizers/rdrop.py``)::

    config = RDropConfig(alpha=5.0).validate()
    out_1, out_2 = model(src, prev), model(src, prev)           # two passes, different dropout draws
    kl, _ = rdrop_kl(out_1, out_2, keep=tgt != pad)             # summed over the real tokens
    loss = rdrop_objective(ce_sum(out_1) + ce_sum(out_2), kl, config.alpha) / (tgt != pad).sum()
"""

import torch

# The kernel's keyed draws are a torch.library.custom_op (rules), which torch has since 2.4.
if not hasattr(getattr(torch, "library", None), "custom_op"):
    raise ImportError(
        f"attn_reg_plugin needs torch >= 2.4 (torch.library.custom_op); this is torch {torch.__version__}: "
        "pip install 'torch>=2.4'"
    )

from .kernel.attention import attend
from .kernel.attention_call import AttentionSite
from .kernel.controller import ATTENTION_KINDS, RegularizationController
from .regularizers.ad_drop import ADDrop
from .regularizers.ad_drop_config import ADDropConfig, ad_drop_epoch
from .regularizers.attendout import AttendOut, AttendOutConfig
from .regularizers.attribution import logit_target, multi_label_target, regression_target, token_loss_target
from .regularizers.attribution_pass import bare_module
from .regularizers.drophead import DropHead, DropHeadConfig
from .regularizers.layerdrop import AttentionLayerDrop, AttentionLayerDropConfig
from .regularizers.rdrop import RDropConfig, concat_with_itself, rdrop_kl, rdrop_objective, split_in_two
from .regularizers.scheduled_dropout import ScheduledAttentionDropout, ScheduledDropoutConfig
from .training.sharding import check_supported_sharding, shard_like

__all__ = [
    "ADDrop",
    "ADDropConfig",
    "ATTENTION_KINDS",
    "AttendOut",
    "AttendOutConfig",
    "AttentionLayerDrop",
    "AttentionLayerDropConfig",
    "AttentionSite",
    "DropHead",
    "DropHeadConfig",
    "RDropConfig",
    "RegularizationController",
    "ScheduledAttentionDropout",
    "ScheduledDropoutConfig",
    "ad_drop_epoch",
    "attend",
    "bare_module",
    "check_supported_sharding",
    "concat_with_itself",
    "logit_target",
    "multi_label_target",
    "rdrop_kl",
    "rdrop_objective",
    "regression_target",
    "shard_like",
    "split_in_two",
    "token_loss_target",
]
