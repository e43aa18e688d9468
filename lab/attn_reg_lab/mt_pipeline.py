"""The translation pipeline the demo and the WMT16 recipes share, over fairseq's real CLIs.

raw parallel text -> joint sentencepiece -> fairseq-preprocess -> fairseq-train (with the
plugin as --user-dir) -> fairseq-generate -> sacrebleu on detokenized output against the raw
references. Every step is a subprocess call of the installed command, exactly what a user
would type; the command lines are logged next to their outputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence

from attn_reg_plugin.prepare import fairseq_command, prepare, run_logged
from attn_reg_plugin.sweep import log_fields
from attn_reg_plugin.user_dir import FAIRSEQ_USER_DIR

from .provenance import environment

SPLITS = ("train", "valid", "test")


def prepare_data(
    raw_dir: Path, work_dir: Path, src: str, tgt: str, vocab_size: int, log: Callable[[str], None] = print
) -> Path:
    """:func:`attn_reg_plugin.prepare.prepare` (the ``attn-reg-prepare`` command) over
    ``raw_dir/{train,valid,test}.{src,tgt}``; returns ``work_dir/data-bin``."""
    return prepare(src, tgt, {split: raw_dir / split for split in SPLITS}, work_dir, vocab_size, log=log)


def prepare_subset(
    raw_dir: Path, work_dir: Path, sizes: Dict[str, int], vocab_size: int, log: Callable[[str], None] = print
) -> Path:
    """:func:`prepare_data` over the first ``sizes[split]`` pairs of each split (absent or 0: all), as
    EN-RO; returns ``work_dir/data-bin``, or the one already there (a resumed run)."""
    data_bin = work_dir / "data-bin"
    if data_bin.exists():
        return data_bin
    subset = work_dir / "raw"
    subset.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for lang in ("en", "ro"):
            # Lines end at \n only, as fairseq-preprocess counts them.
            lines = (raw_dir / f"{split}.{lang}").read_text(encoding="utf-8").split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            size = sizes.get(split, 0)
            if size > len(lines):
                raise SystemExit(f"--{split}-size {size} is more than the {len(lines)} {split} pairs of {raw_dir}")
            (subset / f"{split}.{lang}").write_text("\n".join(lines[: size or None]) + "\n", encoding="utf-8")
    return prepare_data(subset, work_dir, "en", "ro", vocab_size, log=log)


@dataclass
class TrainResult:
    name: str
    save_dir: Path
    train_seconds: float
    best_valid_loss: float
    epochs: List[dict] = field(default_factory=list)


_EPOCH_LINE = re.compile(r"\| (train|valid) \| epoch (\d+) \|(.*)")


def train(
    name: str, data_bin: Path, save_dir: Path, args: Sequence[str], log: Callable[[str], None] = print
) -> TrainResult:
    """fairseq-train with the plugin; prints one line per epoch; returns timings and losses."""
    save_dir.mkdir(parents=True, exist_ok=True)
    epochs: Dict[int, dict] = {}

    def on_line(line: str) -> None:
        m = _EPOCH_LINE.search(line)
        if not m:
            return
        kind, epoch, rest = m.group(1), int(m.group(2)), log_fields(m.group(3))
        rec = epochs.setdefault(epoch, {"epoch": epoch})
        if kind == "train":
            rec.update(
                train_loss=float(rest["loss"]),
                ad_drop_on=rest.get("ad_drop_on"),
                ad_drop_rate=rest.get("ad_drop_rate"),
                train_metrics=rest,
            )
            extra = f" AD-DROP on, dropped {float(rest['ad_drop_rate']):.2%}" if rest.get("ad_drop_on") == "1" else ""
            log(
                f"  [{name}] epoch {epoch:3d} train loss {rest['loss']:>7}{extra} valid loss {rec.get('valid_loss', '?'):>7} wall {rest.get('wall', '?')}s"
            )
        else:
            rec["valid_loss"] = float(rest["loss"])

    cmd = [
        fairseq_command("fairseq-train"),
        str(data_bin),
        "--user-dir",
        FAIRSEQ_USER_DIR,
        "--save-dir",
        str(save_dir),
        "--no-progress-bar",
        "--log-format",
        "simple",
        *args,
    ]
    seconds = run_logged(cmd, save_dir / "train.log", on_line)
    valid = [e["valid_loss"] for e in epochs.values() if "valid_loss" in e]
    if not valid:
        raise RuntimeError(f"no validation result in {save_dir / 'train.log'}")
    return TrainResult(name, save_dir, seconds, min(valid), [epochs[k] for k in sorted(epochs)])


def generate_bleu(
    data_bin: Path, checkpoint: Path, raw_ref: Path, out_dir: Path, extra: Sequence[str] = (), subset: str = "test"
) -> dict:
    """fairseq-generate, then sacrebleu on the detokenized hypotheses against raw references."""
    import sacrebleu

    out_dir.mkdir(parents=True, exist_ok=True)
    gen_log = out_dir / f"generate-{subset}.log"
    seconds = run_logged(
        [
            fairseq_command("fairseq-generate"),
            str(data_bin),
            "--user-dir",
            FAIRSEQ_USER_DIR,
            "--path",
            str(checkpoint),
            "--gen-subset",
            subset,
            "--beam",
            "5",
            "--remove-bpe",
            "sentencepiece",
            "--scoring",
            "sacrebleu",
            "--required-batch-size-multiple",
            "1",
            "--max-tokens",
            "4096",
            *extra,
        ],
        gen_log,
    )
    hyps: Dict[int, str] = {}
    fairseq_bleu = None
    for line in gen_log.read_text(encoding="utf-8").splitlines():
        if line.startswith("D-"):
            ident, _score, text = (line.split("\t") + ["", ""])[:3]
            hyps[int(ident[2:])] = text
        elif "BLEU" in line and line.startswith("Generate"):
            fairseq_bleu = line.strip()
    # Lines end at \n only, as fairseq-preprocess counted them (splitlines would also split at \u2028).
    refs = raw_ref.read_text(encoding="utf-8").split("\n")
    if refs and refs[-1] == "":
        refs.pop()
    if len(hyps) != len(refs):
        raise RuntimeError(f"fairseq-generate produced {len(hyps)} hypotheses for {len(refs)} references ({gen_log})")
    ordered = [hyps[i] for i in range(len(refs))]
    (out_dir / f"{subset}.hyp").write_text("\n".join(ordered) + "\n", encoding="utf-8")
    bleu = sacrebleu.corpus_bleu(ordered, [refs])
    return {
        "bleu": round(bleu.score, 2),
        "signature": str(bleu),
        "fairseq_line": fairseq_bleu,
        "seconds": round(seconds, 1),
    }


def write_table(rows: List[dict], columns: Sequence[tuple], path_md: Path, path_json: Path) -> str:
    """Render rows as a Markdown table (printed and saved) and dump them as JSON with the environment that made them."""
    head = "| " + " | ".join(title for title, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(str(row.get(key, "")) for _, key in columns) + " |" for row in rows]
    table = "\n".join([head, sep, *body])
    path_md.write_text(table + "\n")
    path_json.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=2) + "\n")
    return table
