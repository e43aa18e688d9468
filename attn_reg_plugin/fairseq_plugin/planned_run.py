"""fairseq-train's planned run, for the warning that a regularizer never acts in it
(:func:`attn_reg_plugin.core.regularizers.planned_run.idle_run_warning`), given before the first update."""

import math
from typing import Optional, Tuple

from ..core.regularizers.planned_run import idle_run_warning
from ..core.training.distributed import rank


def planned_run(root, train_batches: Optional[int]) -> Tuple[Optional[int], Optional[int], str]:
    """(planned epochs, planned updates, the flags that set them) of fairseq-train's whole run, from
    ``--max-epoch``, ``--max-update`` and ``--update-freq``; ``train_batches``: this worker's training
    batches per epoch (None: not known, then only the flags count). None: no limit, or not known."""
    optimization = root.optimization
    max_epoch, max_update = int(optimization.max_epoch or 0), int(optimization.max_update or 0)
    update_freq = list(optimization.update_freq or [1])[0]
    per_epoch = math.ceil(train_batches / update_freq) if train_batches else None
    epoch_limits = [max_epoch] if max_epoch else []
    update_limits = [max_update] if max_update else []
    if per_epoch:
        epoch_limits += [math.ceil(max_update / per_epoch)] if max_update else []
        update_limits += [max_epoch * per_epoch] if max_epoch else []
    flags = [f"--max-epoch {max_epoch}"] if max_epoch else []
    flags += [f"--max-update {max_update}"] if max_update else []
    flags += [f"{per_epoch} updates per epoch"] if per_epoch else []
    return min(epoch_limits, default=None), min(update_limits, default=None), ", ".join(flags)


def warn_if_idle(logger, configs, root, train_batches: Optional[int]) -> None:
    """Log (rank 0) a warning for each regularizer config that never acts in the planned run."""
    if root is None or "optimization" not in root or rank() != 0:
        return
    plan = planned_run(root, train_batches)
    for config in configs:
        message = idle_run_warning(config, *plan)
        if message:
            logger.warning(message)
