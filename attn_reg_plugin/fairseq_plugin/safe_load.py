"""Safe checkpoint loading for fairseq on torch >= 2.6.

torch.load now defaults to ``weights_only=True``, which refuses any pickled class it does not
know. A fairseq checkpoint pickles exactly one such class: ``argparse.Namespace`` (the legacy
model args inside ``cfg``). We allow-list that class, rather than turning ``weights_only``
off globally (torch's environment override), so loading a checkpoint never means trusting
arbitrary pickled code: a checkpoint carrying any other global is still refused.
Importing the plugin (``--user-dir``) is enough; fairseq-train resume and fairseq-generate
both import it before they load.
"""
import argparse

import torch

FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoint_globals() -> None:
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch < 2.4 has no weights_only default to satisfy
        add(FAIRSEQ_CHECKPOINT_GLOBALS)


allow_fairseq_checkpoint_globals()
