"""Where AttendOutTrainer draws its held-out samples: the trainer's ``eval_dataset``, or with
``attendout_valid_subset="heldout"`` the set under that key of a dict ``eval_dataset`` (the
counterpart of fairseq's ``--attendout-valid-subset``), so that the set the game chooses the
survivor on need not be the dev set the user reports; ``trainer.evaluate()`` still scores every set."""

from __future__ import annotations

from typing import Optional

import torch


def _named_set(dataset, valid_subset: Optional[str]):
    """The one set of ``eval_dataset`` the held-out samples come from."""
    if isinstance(dataset, dict):
        keys = ", ".join(repr(k) for k in dataset)
        if valid_subset is None:
            raise ValueError(
                f"AttendOutTrainer: eval_dataset is a dict ({keys}); name the set the held-out samples are drawn "
                "from with attendout_valid_subset=<key> (the others are only evaluated)"
            )
        if valid_subset not in dataset:
            raise ValueError(
                f"AttendOutTrainer: attendout_valid_subset={valid_subset!r} is not a key of eval_dataset ({keys})"
            )
        return dataset[valid_subset]
    if valid_subset is not None:
        raise ValueError(
            f"AttendOutTrainer: attendout_valid_subset={valid_subset!r} names a key of a dict eval_dataset, but "
            "eval_dataset is one dataset; pass eval_dataset={..., " + repr(valid_subset) + ": heldout}, or leave "
            "attendout_valid_subset unset to draw from eval_dataset"
        )
    return dataset


def heldout_dataset(trainer, valid_subset: Optional[str] = None):
    """The trainer's held-out set, checked for drawing samples at random, unused columns removed."""
    if trainer.eval_dataset is None:
        raise ValueError(
            "AttendOutTrainer needs eval_dataset: the held-out samples of every dropout step are drawn from it"
        )
    dataset = _named_set(trainer.eval_dataset, valid_subset)
    what = "eval_dataset" if valid_subset is None else f"eval_dataset[{valid_subset!r}]"
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"AttendOutTrainer needs an {what} with len() and indexing (held-out samples are drawn at random)"
        )
    if len(dataset) == 0:
        raise ValueError(f"AttendOutTrainer: {what} is empty; AttendOut needs held-out samples")
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return trainer._remove_unused_columns(dataset, description="AttendOut held-out")
    except ImportError:
        pass
    return dataset
