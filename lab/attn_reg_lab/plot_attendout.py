"""Plot AttendOut's per-layer mean drop probability against updates (paper Fig. 3).

    attn-reg-plot-attendout RUN/attendout_drop_prob.jsonl --out drop_prob.png

The input is the file written by ``--attendout-log-file`` (fairseq) or
``attendout_log_file=`` (Hugging Face): one JSON object per dropout step with ``update`` and
``drop_prob`` ({"encoder-self.0": p, ...}).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple


def read_log(path: Path) -> Tuple[List[int], Dict[str, List[float]]]:
    """Updates and, per layer, the drop probability at each; bad lines raise with file:line."""
    updates: List[int] = []
    series: Dict[str, List[float]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                update, probs = int(record["update"]), record["drop_prob"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not an AttendOut drop-probability record ({err})") from None
            updates.append(update)
            for name, value in probs.items():
                series.setdefault(name, [None] * (len(updates) - 1)).append(float(value))
            for values in series.values():  # layers missing from this record stay aligned
                if len(values) < len(updates):
                    values.append(None)
    if not updates:
        raise ValueError(f"{path}: no records")
    return updates, series


def plot(path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates, series = read_log(Path(path))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in sorted(series, key=lambda n: (n.split(".")[0], int(n.rsplit(".", 1)[1]))):
        ax.plot(updates, series[name], label=name)
    ax.set_xlabel("update")
    ax.set_ylabel("mean drop probability")
    ax.set_title("AttendOut generator: drop probability per attention layer")
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("log", type=Path, help="JSONL written by --attendout-log-file")
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default: next to the log)")
    args = ap.parse_args(argv)
    out = args.out or args.log.with_suffix(".png")
    from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

    try:  # e.g. --out drop.jsonl, or a log named drop.png whose default PNG is itself
        check_outputs_spare_inputs([("--out", out)], [("LOG", args.log)])
    except OutputOverwritesInputError as e:
        ap.error(str(e))
    out = plot(args.log, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
