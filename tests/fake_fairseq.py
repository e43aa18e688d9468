"""Stand-ins for fairseq-train and fairseq-generate, for tests of attn-reg-mt-sweep's own logic
(children, lock, records, report) at a fraction of a second per run.

``install(bin_dir, plan)`` writes executables ``bin_dir/fairseq-train`` and ``fairseq-generate``
that run :func:`main` with the JSON ``plan`` file (:func:`write_plan`):

- ``epochs``: per epoch (1-based list) ``{"valid_loss", "ad_drop_skipped", "updates"}``, defaults
  5.0 - 0.1 x epoch, 0, 10; ``cells``: cell-name substring -> overrides of those per-epoch lists.
- ``hang_after_epoch`` with ``hang_marker``: the first train run (no marker yet) creates the marker
  and sleeps after that epoch, as a run killed there; its PID is written to ``pid_dir``.
- ``hyps``: "<cell>/seed<S>/<split>" substring (the first that matches) -> how hypotheses read: "ref" (the reference), "drop:K"
  (every K-th word dropped), "long" (the reference five times), "junk", "MODE<N" (the reference
  for the first N sentences, MODE for the rest); ``refs``: the references.
- ``fail``: "<cell>/seed<S>/<train, valid or test>" substrings: that child raises a Python error
  and exits 1 (a run that fails in training, or after training when it translates).

A checkpoint is a JSON file ``{"epoch": next epoch, "updates": n}``: like fairseq, train resumes
from ``checkpoint_last.pt`` and says so ("Loaded checkpoint ... (epoch N @ U updates)").
"""

import json
import os
import sys
import time
from pathlib import Path


def write_plan(path: Path, **plan) -> Path:
    path.write_text(json.dumps(plan), encoding="utf-8")
    return path


def install(bin_dir: Path, plan: Path) -> dict:
    """The two executables, as ``{name: path}``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, mode in (("fairseq-train", "train"), ("fairseq-generate", "generate")):
        exe = bin_dir / name
        exe.write_text(
            f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"import fake_fairseq\nfake_fairseq.main({mode!r}, {str(plan)!r}, sys.argv[1:])\n",
            encoding="utf-8",
        )
        exe.chmod(0o755)
        out[name] = str(exe)
    return out


def _value(args, option, default=None):
    return args[args.index(option) + 1] if option in args else default


def _epoch_plan(plan: dict, cell: str, epoch: int) -> dict:
    spec = {"valid_loss": 5.0 - 0.1 * epoch, "ad_drop_skipped": 0, "updates": 10}
    for key, values in plan.get("epochs", {}).items():
        spec[key] = values[epoch - 1]
    for part, override in plan.get("cells", {}).items():
        if part in cell:
            for key, values in override.items():
                spec[key] = values[epoch - 1]
    return spec


def train(plan: dict, args) -> None:
    save = Path(_value(args, "--save-dir"))
    cell = save.parent.parent.name
    ad_drop = _value(args, "--criterion") == "ad_drop_label_smoothed_cross_entropy"
    save.mkdir(parents=True, exist_ok=True)
    if plan.get("pid_dir"):
        (Path(plan["pid_dir"]) / f"train-{os.getpid()}").write_text(str(os.getpid()))
    last = save / "checkpoint_last.pt"
    start, updates = 1, 0
    if last.exists():
        state = json.loads(last.read_text())
        start, updates = state["epoch"], state["updates"]
        print(
            f"2024-01-01 00:00:00 | INFO | fairseq.trainer | Loaded checkpoint {last} (epoch {start} @ {updates} updates)",
            flush=True,
        )
    for epoch in range(start, int(_value(args, "--max-epoch")) + 1):
        spec = _epoch_plan(plan, cell, epoch)
        updates += spec["updates"]
        extra = f" | ad_drop_on 1 | ad_drop_rate 0.05 | ad_drop_skipped {spec['ad_drop_skipped']}" if ad_drop else ""
        if spec["ad_drop_skipped"] >= spec["updates"] and ad_drop:
            extra = f" | ad_drop_on 1 | ad_drop_rate 0 | ad_drop_skipped {spec['ad_drop_skipped']}"
        print(
            f"2024-01-01 00:00:00 | INFO | train | epoch {epoch:03d} | loss 6.1{extra} | num_updates {updates}",
            flush=True,
        )
        print(f"2024-01-01 00:00:00 | INFO | valid | epoch {epoch:03d} | valid on 'valid' subset | loss {spec['valid_loss']:g} | num_updates {updates}", flush=True)  # fmt: skip
        for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
            (save / name).write_text(json.dumps({"epoch": epoch + 1, "updates": updates}))
        marker = Path(plan["hang_marker"]) if plan.get("hang_marker") else None
        if plan.get("hang_after_epoch") == epoch and marker is not None and not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(600)


def _hypothesis(mode: str, ref: str, index: int = 0) -> str:
    if "<" in mode:  # "MODE<N": the reference for sentences 0..N-1, MODE for the rest
        mode, n = mode.split("<")
        if index < int(n):
            return ref
    words = ref.split()
    if mode.startswith("drop:"):
        k = int(mode[5:])
        return " ".join(w for i, w in enumerate(words) if i % k != k - 1)
    return {"ref": ref, "long": " ".join([ref] * 5), "junk": "zzz " * 3}[mode].strip()


def generate(plan: dict, args) -> None:
    run = Path(_value(args, "--path")).parent.parent  # runs/<cell>/seed<S>
    key = f"{run.parent.name}/{run.name}/{_value(args, '--gen-subset')}"  # <cell>/seed<S>/<split>
    mode = next((m for part, m in plan.get("hyps", {}).items() if part in key), "ref")
    for i, ref in enumerate(plan["refs"]):
        print(
            f"S-{i}\tsource {i}\nT-{i}\t{ref}\nH-{i}\t-0.5\t{ref}\nD-{i}\t-0.5\t{_hypothesis(mode, ref, i)}", flush=True
        )


def _fail_if_planned(plan: dict, mode: str, args) -> None:
    path = Path(_value(args, "--save-dir") if mode == "train" else Path(_value(args, "--path")).parent)
    key = f"{path.parent.parent.name}/{path.parent.name}/{'train' if mode == 'train' else _value(args, '--gen-subset')}"
    if any(part in key for part in plan.get("fail", [])):
        sys.exit(f"RuntimeError: the stand-in fairseq-{mode} fails {key}, as planned")


def main(mode: str, plan_path: str, args) -> None:
    plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
    _fail_if_planned(plan, mode, args)
    (train if mode == "train" else generate)(plan, args)
