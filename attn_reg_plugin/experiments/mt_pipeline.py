"""The translation pipeline the demo and the WMT16 recipes share, over fairseq's real CLIs.

raw parallel text -> joint sentencepiece -> fairseq-preprocess -> fairseq-train (with the
plugin as --user-dir) -> fairseq-generate -> sacrebleu on detokenized output against the raw
references. Every step is a subprocess call of the installed command, exactly what a user
would type; the command lines are logged next to their outputs.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .paths import PLUGIN_DIR
BIN = Path(sys.executable).parent  # the venv's console scripts (fairseq-train, ...)
SPLITS = ("train", "valid", "test")


def fairseq_cmd(name: str) -> str:
    exe = BIN / name
    if not exe.exists():
        raise FileNotFoundError(f"{exe} not found: run inside the project's venv (make .venv)")
    return str(exe)


def run_logged(cmd: Sequence[str], log_path: Path, on_line: Optional[Callable[[str], None]] = None,
               env: Optional[Dict[str, str]] = None) -> float:
    """Run ``cmd``, tee its output into ``log_path``, call ``on_line`` per line; return seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        for line in proc.stdout:
            log.write(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
        code = proc.wait()
    if code != 0:
        tail = log_path.read_text().splitlines()[-25:]
        raise RuntimeError(f"command failed with exit code {code}: {cmd[0]}\n  log: {log_path}\n" + "\n".join(tail))
    return time.time() - start


class CorpusError(ValueError):
    """Malformed parallel text; the message names the file and, where there is one, the line."""


def check_text_file(path: Path) -> int:
    """Number of lines of ``path`` after checking every one; raises :class:`CorpusError`.

    Read as bytes split at ``\\n`` only, so the count is the one every later tool sees:
    a line must be UTF-8, must hold some non-whitespace text, and must not contain a lone
    ``\\r``: Python's text mode (which encodes the corpus below) and fairseq-preprocess end a
    line there while ``wc -l`` does not, so one side would silently shift. CRLF endings are fine.
    """
    if not path.exists():
        raise FileNotFoundError(f"missing {path}")
    count = 0
    with open(path, "rb") as f:
        for count, raw in enumerate(f, start=1):
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if line.endswith(b"\r"):
                line = line[:-1]
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}:{count}: not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)") from None
            if "\r" in text:
                raise CorpusError(f"{path}:{count}: carriage return inside the line (tools disagree on where such a line ends)")
            if not text.strip():
                raise CorpusError(f"{path}:{count}: empty line (every line must be a sentence; remove the pair from both sides)")
    if count == 0:
        raise CorpusError(f"{path}: the file is empty")
    return count


def check_parallel(raw_dir: Path, src: str, tgt: str, splits: Sequence[str] = SPLITS) -> Dict[str, int]:
    """Pairs per split after checking every line of both sides; nothing is skipped or truncated.

    Raises :class:`CorpusError` naming the file and line of the first problem: invalid UTF-8,
    an empty line, a carriage return inside a line, or sides with different line counts.
    """
    counts = {}
    for split in splits:
        paths = {lang: raw_dir / f"{split}.{lang}" for lang in (src, tgt)}
        n = {lang: check_text_file(path) for lang, path in paths.items()}
        if n[src] != n[tgt]:
            longer = src if n[src] > n[tgt] else tgt
            raise CorpusError(
                f"{paths[src]} has {n[src]} lines but {paths[tgt]} has {n[tgt]}: "
                f"{paths[longer]}:{min(n.values()) + 1} has no counterpart"
            )
        counts[split] = n[src]
    return counts


def prepare_data(raw_dir: Path, work_dir: Path, src: str, tgt: str, vocab_size: int,
                 log: Callable[[str], None] = print) -> Path:
    """Train a joint sentencepiece model on train, encode all splits, binarize; return data-bin."""
    import sentencepiece as spm

    counts = check_parallel(raw_dir, src, tgt)
    log(f"data: {raw_dir} ({', '.join(f'{k} {v}' for k, v in counts.items())} pairs)")
    spm_dir = work_dir / "spm"
    spm_dir.mkdir(parents=True, exist_ok=True)
    prefix = spm_dir / "spm"
    spm.SentencePieceTrainer.train(
        input=f"{raw_dir}/train.{src},{raw_dir}/train.{tgt}", model_prefix=str(prefix), vocab_size=vocab_size,
        character_coverage=1.0, model_type="unigram", num_threads=2, minloglevel=2, seed_sentencepiece_size=200000,
    )
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    for split in SPLITS:
        for lang in (src, tgt):
            with open(raw_dir / f"{split}.{lang}", encoding="utf-8") as fin, open(spm_dir / f"{split}.{lang}", "w", encoding="utf-8") as fout:
                for line in fin:
                    fout.write(" ".join(sp.encode(line.rstrip("\n"), out_type=str)) + "\n")
    data_bin = work_dir / "data-bin"
    run_logged([
        fairseq_cmd("fairseq-preprocess"), "--source-lang", src, "--target-lang", tgt,
        "--trainpref", str(spm_dir / "train"), "--validpref", str(spm_dir / "valid"), "--testpref", str(spm_dir / "test"),
        "--destdir", str(data_bin), "--joined-dictionary", "--workers", "2",
    ], work_dir / "logs" / "preprocess.log")
    log(f"sentencepiece ({vocab_size} pieces) + fairseq-preprocess -> {data_bin}")
    return data_bin


@dataclass
class TrainResult:
    name: str
    save_dir: Path
    train_seconds: float
    best_valid_loss: float
    epochs: List[dict] = field(default_factory=list)


_EPOCH_LINE = re.compile(r"\| (train|valid) \| epoch (\d+) \|(.*)")


def _metrics(text: str) -> Dict[str, str]:
    out = {}
    for part in text.split("|"):
        bits = part.strip().split(" ", 1)
        if len(bits) == 2:
            out[bits[0]] = bits[1].strip()
    return out


def train(name: str, data_bin: Path, save_dir: Path, args: Sequence[str], log: Callable[[str], None] = print) -> TrainResult:
    """fairseq-train with the plugin; prints one line per epoch; returns timings and losses."""
    save_dir.mkdir(parents=True, exist_ok=True)
    epochs: Dict[int, dict] = {}

    def on_line(line: str) -> None:
        m = _EPOCH_LINE.search(line)
        if not m:
            return
        kind, epoch, rest = m.group(1), int(m.group(2)), _metrics(m.group(3))
        rec = epochs.setdefault(epoch, {"epoch": epoch})
        if kind == "train":
            rec.update(train_loss=float(rest["loss"]), ad_drop_on=rest.get("ad_drop_on"), ad_drop_rate=rest.get("ad_drop_rate"),
                       train_metrics=rest)
            extra = f" AD-DROP on, dropped {float(rest['ad_drop_rate']):.2%}" if rest.get("ad_drop_on") == "1" else ""
            log(f"  [{name}] epoch {epoch:3d} train loss {rest['loss']:>7}{extra} valid loss {rec.get('valid_loss', '?'):>7} wall {rest.get('wall', '?')}s")
        else:
            rec["valid_loss"] = float(rest["loss"])

    cmd = [fairseq_cmd("fairseq-train"), str(data_bin), "--user-dir", str(PLUGIN_DIR), "--save-dir", str(save_dir),
           "--no-progress-bar", "--log-format", "simple", *args]
    seconds = run_logged(cmd, save_dir / "train.log", on_line)
    valid = [e["valid_loss"] for e in epochs.values() if "valid_loss" in e]
    if not valid:
        raise RuntimeError(f"no validation result in {save_dir / 'train.log'}")
    return TrainResult(name, save_dir, seconds, min(valid), [epochs[k] for k in sorted(epochs)])


def generate_bleu(data_bin: Path, checkpoint: Path, raw_ref: Path, out_dir: Path, extra: Sequence[str] = (),
                  subset: str = "test") -> dict:
    """fairseq-generate, then sacrebleu on the detokenized hypotheses against raw references."""
    import sacrebleu

    out_dir.mkdir(parents=True, exist_ok=True)
    gen_log = out_dir / f"generate-{subset}.log"
    seconds = run_logged([
        fairseq_cmd("fairseq-generate"), str(data_bin), "--user-dir", str(PLUGIN_DIR), "--path", str(checkpoint),
        "--gen-subset", subset, "--beam", "5", "--remove-bpe", "sentencepiece", "--scoring", "sacrebleu",
        "--required-batch-size-multiple", "1", "--max-tokens", "4096", *extra,
    ], gen_log)
    hyps: Dict[int, str] = {}
    fairseq_bleu = None
    for line in gen_log.read_text(encoding="utf-8").splitlines():
        if line.startswith("D-"):
            ident, _score, text = (line.split("\t") + ["", ""])[:3]
            hyps[int(ident[2:])] = text
        elif "BLEU" in line and line.startswith("Generate"):
            fairseq_bleu = line.strip()
    refs = raw_ref.read_text(encoding="utf-8").splitlines()
    if len(hyps) != len(refs):
        raise RuntimeError(f"fairseq-generate produced {len(hyps)} hypotheses for {len(refs)} references ({gen_log})")
    ordered = [hyps[i] for i in range(len(refs))]
    (out_dir / f"{subset}.hyp").write_text("\n".join(ordered) + "\n", encoding="utf-8")
    bleu = sacrebleu.corpus_bleu(ordered, [refs])
    return {"bleu": round(bleu.score, 2), "signature": str(bleu), "fairseq_line": fairseq_bleu, "seconds": round(seconds, 1)}


def write_table(rows: List[dict], columns: Sequence[tuple], path_md: Path, path_json: Path) -> str:
    """Render rows as a Markdown table (printed and saved) and dump them as JSON."""
    head = "| " + " | ".join(title for title, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(str(row.get(key, "")) for _, key in columns) + " |" for row in rows]
    table = "\n".join([head, sep, *body])
    path_md.write_text(table + "\n")
    path_json.write_text(json.dumps(rows, indent=2) + "\n")
    return table
