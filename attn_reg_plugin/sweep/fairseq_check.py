"""Each run's fairseq-train command line, checked in process before any run trains: parsed as
fairseq-train parses it, then its task, model and criterion built as fairseq-train builds them,
where fairseq and the plugin validate every option."""

from __future__ import annotations

import contextlib
import io
import re
from typing import List

from .options import SweepError, cell_name
from .runs import train_command


def check_fairseq_args(opts, cells: List[dict]) -> None:
    """Each cell's fairseq-train command line, checked in process as fairseq-train checks it before
    its first update: parsed (a typo fails with fairseq's own message), then its task, model and
    criterion built (:func:`_build_as_fairseq_train`), where the plugin validates every option
    (``--rdrop-alpha -3``, a layer the model lacks). So a method's bad option is refused before any
    run trains, not after the methods before it have."""
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from fairseq import options  # its import sets the root logger to DEBUG with a handler: undone below

    root.setLevel(level)
    root.handlers[:] = handlers
    checked = []
    for cell in cells:
        if cell in checked:
            continue
        checked.append(cell)
        argv = train_command(cell, opts.seeds[0], opts, opts.out_dir / "runs" / "check")
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                args = options.parse_args_and_arch(options.get_training_parser(), argv)
        except SystemExit:
            lines = err.getvalue().strip().splitlines() or ["(no message)"]
            message = re.sub(r"^\S+: error: ", "", lines[-1])  # argparse's prog is this process's argv[0]
            raise SweepError(
                f"the fairseq-train arguments after '--' do not parse for the {cell['method']} runs: "
                f"fairseq-train: error: {message}"
            ) from None
        try:
            _build_as_fairseq_train(args)
        except Exception as e:
            name = cell_name(cell)
            what = name if name == cell["method"] else f"{name} ({cell['method']})"
            own = f" (its options: {' '.join(cell['args'])})" if "args" in cell else ""
            raise SweepError(f"{what} would stop before training, refused by fairseq-train: {e}{own}") from None


def _build_as_fairseq_train(args) -> None:
    """Set up the task and build the model and criterion from parsed fairseq-train ``args``, as
    fairseq-train does before training: whatever the plugin refuses raises here. The model is built
    on torch's meta device (no memory, no weights: a big model costs a fraction of a second); a
    build that cannot run there (AttendOut copies tensors) is redone on the CPU, where only a real
    refusal can fail it."""
    import warnings

    import torch
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def build(device: str) -> None:
        cfg = convert_namespace_to_omegaconf(args)
        task = tasks.setup_task(cfg.task)
        with torch.device(device):
            task.build_model(cfg.model)
            task.build_criterion(cfg.criterion)

    # The real run shows its warnings in its own log; here they would only be noise (or, where
    # warnings are errors, a false refusal).
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        try:
            build("meta")
        except ValueError:  # the plugin's and fairseq's refusals
            raise
        except Exception:  # the meta device's own limits: build for real
            build("cpu")
