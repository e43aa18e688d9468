"""``attn-reg-average-checkpoints``: fairseq's checkpoint averaging, from the installed packages.

fairseq's ``scripts/average_checkpoints.py`` is in a fairseq checkout, not in the pip package.
This is the same averaging with the same options (``--inputs``, ``--output``,
``--num-epoch-checkpoints``, ``--num-update-checkpoints``, ``--checkpoint-upper-bound``): the
``model`` tensors of the inputs are averaged (integer tensors floor-divided, half tensors in
fp32) into the first input's state, which is written to ``--output`` for ``fairseq-generate``.
Each input is read with torch's safe unpickler after the plugin's allow-list
(``fairseq_plugin.safe_load``), so stock fairseq checkpoints (``argparse.Namespace``) and
``--eval-bleu`` runs (numpy BLEU counts) load, and a checkpoint carrying any other global is refused.
The output's ``extra_state`` holds plain Python numbers and lists where the input held numpy scalars
and arrays (``--eval-bleu``'s counts), so stock fairseq, without the plugin's allow-list, loads it.
"""

import argparse
import collections
import copy
import os
import re

PATTERNS = {"epoch": r"checkpoint(\d+)\.pt", "update": r"checkpoint_\d+_(\d+)\.pt"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="attn-reg-average-checkpoints",
        allow_abbrev=False,
        description="Average the parameters of fairseq checkpoints into a new checkpoint "
        "(fairseq's scripts/average_checkpoints.py, with torch's safe loading).",
    )
    parser.add_argument("--inputs", required=True, nargs="+", help="checkpoint files, or one --save-dir with --num-*")
    parser.add_argument("--output", required=True, metavar="FILE", help="the averaged checkpoint to write")
    last = parser.add_mutually_exclusive_group()
    last.add_argument(
        "--num-epoch-checkpoints", type=int, help="average the last N checkpointEPOCH.pt of the --inputs folder"
    )
    last.add_argument(
        "--num-update-checkpoints",
        type=int,
        help="average the last N checkpoint_EPOCH_UPDATE.pt of the --inputs folder (--save-interval-updates)",
    )
    parser.add_argument(
        "--checkpoint-upper-bound",
        type=int,
        help="with --num-*-checkpoints: the last epoch (or update) to use, e.g. 50 with 10 averages epochs 41-50",
    )
    args = parser.parse_args(argv)
    kind = "epoch" if args.num_epoch_checkpoints is not None else "update"
    count = args.num_epoch_checkpoints if kind == "epoch" else args.num_update_checkpoints
    if count is None:
        if args.checkpoint_upper_bound is not None:
            parser.error("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
        return args
    if count < 1:
        parser.error(f"--num-{kind}-checkpoints must be >= 1, got {count}")
    if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
        parser.error(f"--num-{kind}-checkpoints needs one folder as --inputs (a --save-dir), got {args.inputs}")
    args.inputs = last_checkpoints(args.inputs[0], count, kind, args.checkpoint_upper_bound, parser.error)
    return args


def last_checkpoints(folder: str, count: int, kind: str, upper_bound, error) -> list:
    """The ``count`` newest epoch (or update) checkpoints of ``folder``, newest first, as fairseq's script."""
    found = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(folder)
        if (m := re.fullmatch(PATTERNS[kind], name)) and (upper_bound is None or int(m.group(1)) <= upper_bound)
    )
    if len(found) < count:
        bound = f" up to {kind} {upper_bound}" if upper_bound is not None else ""
        error(
            f"--num-{kind}-checkpoints {count}: {folder} holds {len(found)} {kind} checkpoint(s){bound} "
            f"({', '.join(name for _, name in found) or 'none'})"
        )
    return [os.path.join(folder, name) for _, name in reversed(found[-count:])]


def plain_numbers(value):
    """``value`` with every numpy array as a (nested) list and every numpy scalar as a Python number,
    inside dicts, lists and tuples of the same types; anything else unchanged."""
    import numpy

    if isinstance(value, numpy.ndarray):
        return value.tolist()
    if isinstance(value, numpy.generic):
        return value.item()
    if isinstance(value, dict):
        out = copy.copy(value)  # the same dict type (OrderedDict, defaultdict)
        for key, item in value.items():
            out[key] = plain_numbers(item)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(plain_numbers(item) for item in value)
    return value


def average_checkpoints(inputs) -> dict:
    """The first input's state with ``model`` replaced by the mean of every input's ``model``."""
    import torch

    try:
        from .fairseq_plugin import safe_load  # noqa: F401  (the allow-list for torch's safe unpickler)
    except ImportError as e:
        raise SystemExit(f"attn-reg-average-checkpoints needs fairseq (the plugin's [fairseq] extra): {e}") from e
    new_state, sums, keys = None, collections.OrderedDict(), None
    for path in inputs:
        state = torch.load(path, map_location="cpu", weights_only=True)
        new_state = new_state if new_state is not None else state
        if keys is None:
            keys = list(state["model"])
        elif list(state["model"]) != keys:
            raise SystemExit(f"attn-reg-average-checkpoints: {path} holds other parameters than {inputs[0]}")
        for key, value in state["model"].items():
            value = value.float() if value.dtype == torch.half else value
            sums[key] = value.clone() if key not in sums else sums[key] + value  # clone: shared parameters
    n = len(inputs)
    new_state["model"] = collections.OrderedDict(
        (key, value / n if value.is_floating_point() else value // n) for key, value in sums.items()
    )
    # torch's safe unpickler refuses numpy without the plugin's allow-list, and the averaged file is
    # for stock tools (fairseq-generate --task translation): --eval-bleu's numpy counts become lists.
    if "extra_state" in new_state:
        new_state["extra_state"] = plain_numbers(new_state["extra_state"])
    return new_state


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    for path in args.inputs:
        if os.path.isdir(path):
            raise SystemExit(
                f"attn-reg-average-checkpoints: --inputs {path} is a folder: average its last N checkpoints "
                "with --num-epoch-checkpoints N (or --num-update-checkpoints N), or name the files"
            )
        if not os.path.isfile(path):
            raise SystemExit(f"attn-reg-average-checkpoints: --inputs: no such file: {path}")
    state = average_checkpoints(args.inputs)
    torch.save(state, args.output)
    print(f"averaged {len(args.inputs)} checkpoints ({', '.join(args.inputs)}) into {args.output}")


if __name__ == "__main__":
    main()
