"""Safe checkpoint loading for fairseq on torch >= 2.6.

torch.load now defaults to ``weights_only=True``, which refuses any pickled class it does not
know. A fairseq checkpoint file pickles exactly one such class: ``argparse.Namespace`` (the
legacy model args inside ``cfg``). We allow-list that class, rather than turning
``weights_only`` off globally (torch's environment override), so loading a checkpoint never
means trusting arbitrary pickled code: a checkpoint carrying any other global is still refused.
Importing the plugin (``--user-dir``) is enough; fairseq-train resume and fairseq-generate
both import it before they load.

A distributed run that resumes unpickles one more object the same way: fairseq's trainer
loads the checkpoint on rank 0 only, turns its ``cfg`` into an omegaconf ``DictConfig`` and
sends the whole state to the other ranks with ``torch.save`` / ``torch.load``
(``distributed_utils.broadcast_object``), tensors replaced by ``_TensorPlaceholder``s. Without
the classes below every rank but 0 fails to unpickle it. They are data containers whose
unpickling sets attributes and calls nothing else (``dict``, ``list``, ``int`` and
``defaultdict`` appear as the container types omegaconf records).
"""

import argparse
import collections
import typing

import torch

FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace]


def fairseq_broadcast_globals() -> list:
    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    return [
        DictConfig,
        ListConfig,
        AnyNode,
        ContainerMetadata,
        Metadata,
        typing.Any,
        dict,
        list,
        int,
        collections.defaultdict,
        _TensorPlaceholder,
    ]


def allow_fairseq_checkpoint_globals() -> None:
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch < 2.4 has no weights_only default to satisfy
        add(FAIRSEQ_CHECKPOINT_GLOBALS + fairseq_broadcast_globals())


allow_fairseq_checkpoint_globals()
