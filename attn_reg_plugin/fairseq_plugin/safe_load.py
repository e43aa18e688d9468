"""Safe checkpoint loading for fairseq on torch >= 2.6.

torch.load now defaults to ``weights_only=True``, which refuses any pickled class it does not
know. A fairseq checkpoint file pickles two kinds of such objects: ``argparse.Namespace`` (the
legacy model args inside ``cfg``) and, after ``--eval-bleu`` validation, numpy arrays (the BLEU
n-gram counts fairseq's meters keep in ``extra_state["metrics"]``). We allow-list those classes
(``numpy_array_globals``: int64 and float64 arrays only), rather than turning
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

import numpy
import torch
from torch.torch_version import TorchVersion

FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace]


def numpy_array_globals() -> list:
    """What unpickling an int64 or float64 numpy array needs: the function numpy pickles arrays
    with, ``ndarray``, ``dtype`` and the two dtypes' classes (numpy >= 1.25 builds a dtype as an
    instance of its own class, e.g. ``numpy.dtypes.Int64DType``). fairseq's BLEU meters hold int64
    counts; the attn_reg task's all-empty validation logs float64 zeros. Arrays of any other dtype,
    object arrays included (their items would be pickled objects), stay refused."""
    reconstruct = numpy.zeros(0).__reduce__()[0]
    allowed = [reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype("int64")), type(numpy.dtype("float64"))]
    if TorchVersion(torch.__version__) >= (2, 6):  # (global, name) pairs: torch >= 2.6
        # numpy 2 renamed numpy.core to numpy._core: a checkpoint pickled under either version loads
        allowed += [(reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")]
    return allowed


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
        add(FAIRSEQ_CHECKPOINT_GLOBALS + numpy_array_globals() + fairseq_broadcast_globals())


allow_fairseq_checkpoint_globals()
