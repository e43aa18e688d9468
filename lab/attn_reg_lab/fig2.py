"""AD-DROP's Fig. 2 on real data: which attention positions, when dropped, slow overfitting (``attn-reg-fig2``).

    attn-reg-fig2 --out-dir outputs/fig2/minilm        # MiniLM on 400 movie reviews, 4 strategies x 3 seeds
    attn-reg-fig2 --train-size 200 --epochs 6 --seeds 1 --strategies none,high --out-dir OUT
    attn-reg-fig2 --backend fairseq --train-size 2000 --epochs 30 --out-dir outputs/fig2/fairseq

The paper (Sec. 2.2, Fig. 2) fine-tunes RoBERTa-base on MRPC. It attributes the gold-label logit
by gradient to the first layer's attention maps, then per query row drops positions of high or
of low attribution at rate 0.3, against random dropping and no dropping, always on (no
cross-tuning), and plots train and dev loss after every epoch. This runner does the same with the
offline pretrained MiniLM (6 layers, hidden 384) on a class-balanced subset of the shipped movie
reviews. Each strategy is an ``ADDropConfig`` with ``schedule="always"``, ``layers="0"``,
``attention="encoder-self"``, ``attribution="ga"`` and ``labels="gold"``:

* ``high``: ``region="top"``, p = 0.5, q = 0.6. The candidates are the row's higher-attribution half;
* ``low``: ``region="bottom"``, p = 0.5, q = 0.6. The candidates are the lower half;
* ``random``: ``attribution="rd"``, p = 0.5, q = 0.6. The candidates are a random half;
* ``none``: the stock Trainer.

In each of the first three, a row loses 0.3 of its real keys in expectation (p·q). Short rows lose
a little more: the region is ceil(p·n) keys, and a row keeps at least one key. The high and low
candidate regions are disjoint halves. The drop rate each run applied is recorded.

After every epoch, in eval mode (no dropout, nothing dropped), it records:
* ``train_loss``: the mean cross-entropy on the training subset;
* ``dev_loss``: the same on the dev subset;
* ``dev_acc``.

Beside them it records the Trainer's running training loss (``running_loss``, under dropping). The
paper's "training loss" is most likely this one. The two differ most for ``low``: a model trained
with its low-attribution keys dropped fits fast under that dropping and badly without it.

``--backend fairseq`` runs the same four strategies on the demo's Transformer (attn-reg-demo's model,
with a warm-up of ``--warmup-updates``, 50: a 1,000-pair epoch is 29 updates) trained from
scratch on the first ``--train-size`` pairs of the shipped EN-RO corpus. The
attribution target is the negative token loss of the reference (``labels="gold"``) and the maps are
the encoder self-attention of layer 0. fairseq logs no eval-mode training loss, so its
``train_loss`` is the running loss of the epoch, under dropping. ``dev_loss`` is the valid loss. Both
are fairseq's label-smoothed loss in base 2.
``results.json`` has every run with its curves and the mean over seeds. ``fig2.png`` plots the
means of the three losses, with a band from the lowest to the highest seed. ``runs.jsonl`` grows as runs finish, and
a rerun with the same settings skips the runs it already holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

from .arguments import comma_list
from .curves import band, draw_band, seeds_label, zoom_start
from .fewshot import encode, eval_batches
from .fewshot_data import DataError, load_jsonl, sample_balanced
from .fewshot_summary import paired_difference
from .paths import MOVIE_REVIEWS, MT_CORPUS, checkout_data, require_minilm
from .provenance import environment
from .resume import finished_runs, record_run

STRATEGIES = ("none", "high", "low", "random")
P, Q = 0.5, 0.6  # expected drop rate p*q = 0.3, the paper's


def strategy_config(strategy: str):
    """The ADDropConfig of a strategy (None: no dropping)."""
    if strategy == "none":
        return None
    common = dict(p=P, q=Q, schedule="always", layers="0", attention="encoder-self", labels="gold")
    if strategy == "random":
        return ADDropConfig(attribution="rd", **common)
    return ADDropConfig(attribution="ga", region="top" if strategy == "high" else "bottom", **common)


def eval_loss_and_accuracy(model, batches: List[dict]):
    import torch

    was_training = model.training
    model.eval()
    total_loss = correct = count = 0
    with torch.no_grad():
        for batch in batches:
            out = model(**batch)
            n = len(batch["labels"])
            total_loss += float(out.loss) * n
            correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
            count += n
    model.train(was_training)
    return total_loss / count, correct / count


def run_one(opts, strategy: str, seed: int, tokenizer, train_examples, dev_batches) -> Dict:
    import transformers

    from attn_reg_plugin.hf import ADDropTrainer

    subset = sample_balanced(train_examples, opts.train_size, seed, 2)
    train = encode(tokenizer, subset, opts.max_length)
    train_batches = eval_batches(tokenizer, train, 64)
    transformers.set_seed(seed)  # the classifier head: the same initial weights for every strategy
    model = transformers.AutoModelForSequenceClassification.from_pretrained(opts.model, num_labels=2)
    curve: List[Dict] = []

    class EachEpoch(transformers.TrainerCallback):
        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            train_loss, _ = eval_loss_and_accuracy(model, train_batches)
            dev_loss, dev_acc = eval_loss_and_accuracy(model, dev_batches)
            curve.append({"epoch": len(curve) + 1, "train_loss": train_loss, "dev_loss": dev_loss, "dev_acc": dev_acc})

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="fig2-") as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, num_train_epochs=opts.epochs, per_device_train_batch_size=opts.batch_size,
            learning_rate=opts.lr, lr_scheduler_type="constant", seed=seed, data_seed=seed, logging_strategy="epoch",
            save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
            remove_unused_columns=False, dataloader_pin_memory=False,
        )  # fmt: skip
        common = dict(
            model=model,
            args=args,
            train_dataset=train,
            data_collator=transformers.DataCollatorWithPadding(tokenizer),
            callbacks=[EachEpoch()],
        )
        config = strategy_config(strategy)
        trainer = transformers.Trainer(**common) if config is None else ADDropTrainer(**common, ad_drop=config)
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if len(logs) != opts.epochs or len(curve) != opts.epochs:
        raise RuntimeError(f"expected {opts.epochs} epoch logs and evaluations, got {len(logs)} and {len(curve)}")
    for row, log in zip(curve, logs):
        row["running_loss"] = log["loss"]
        row["drop_rate"] = log.get("ad_drop_rate", 0.0)
    return {
        "strategy": strategy,
        "seed": seed,
        "train_seconds": round(time.time() - started, 1),
        "epochs": curve,
    }


def fairseq_strategy_args(strategy: str) -> List[str]:
    """The fairseq flags of a strategy: the same ADDropConfig as the HF runs, on encoder layer 0."""
    config = strategy_config(strategy)
    if config is None:
        return ["--criterion", "label_smoothed_cross_entropy"]
    args = ["--criterion", "ad_drop_label_smoothed_cross_entropy"]
    for name in ("p", "q", "region", "attribution", "schedule", "layers", "attention", "labels"):
        args += [config.name(name), str(getattr(config, name))]
    return args


def run_one_fairseq(opts, strategy: str, seed: int, data_bin: Path) -> Dict:
    from . import mt_pipeline as mt
    from .demo import MODEL_ARGS

    model_args = list(MODEL_ARGS)
    model_args[model_args.index("--dropout") + 1] = str(opts.dropout)
    model_args[model_args.index("--warmup-updates") + 1] = str(opts.warmup_updates)
    with tempfile.TemporaryDirectory(prefix="fig2-fairseq-") as tmp:
        result = mt.train(
            f"{strategy} seed {seed}",
            data_bin,
            Path(tmp),
            [
                *model_args,
                "--cpu",
                "--no-save",
                *fairseq_strategy_args(strategy),
                "--max-epoch",
                str(opts.epochs),
                "--seed",
                str(seed),
            ],  # fmt: skip
            log=lambda line: None,
        )
    curve = [
        {
            "epoch": e["epoch"],
            "train_loss": e["train_loss"],
            "dev_loss": e["valid_loss"],
            "drop_rate": float(e.get("ad_drop_rate") or 0.0),
        }
        for e in result.epochs
    ]
    if len(curve) != opts.epochs:
        raise RuntimeError(f"expected {opts.epochs} epochs in the fairseq log, got {len(curve)}")
    return {"strategy": strategy, "seed": seed, "train_seconds": round(result.train_seconds, 1), "epochs": curve}


def summarize(runs: List[Dict], strategies, epochs: int) -> Dict[str, Dict[str, List[float]]]:
    """Per strategy and measure: the mean, lowest and highest over seeds at every epoch."""
    summary = {}
    for strategy in strategies:
        mine = [r for r in runs if r["strategy"] == strategy]
        if not mine:
            continue
        summary[strategy] = {"seeds": len(mine)}
        for key in ("running_loss", "train_loss", "dev_loss", "dev_acc", "drop_rate"):
            if key not in mine[0]["epochs"][0]:
                continue
            summary[strategy][key] = band(mine, key, epochs)
    return summary


def _mean_std_text(values: List[float], digits: int) -> str:
    text = f"{statistics.fmean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def markdown(runs: List[Dict], strategies, train_panels) -> str:
    """The table behind the picture, mean ± sample std over seeds, and each strategy minus ``none`` by seed.

    ``train_panels`` are the (key, label) training losses to report. They are read at the last epoch
    and at ``none``'s turning point: the epoch where its mean dev loss is lowest, where plain
    training starts to overfit. The fitting speeds are compared there."""
    mine = {s: sorted((r for r in runs if r["strategy"] == s), key=lambda r: r["seed"]) for s in strategies}
    mine = {s: rs for s, rs in mine.items() if rs}
    turn = None
    if "none" in mine:
        mean_dev = [statistics.fmean(c) for c in zip(*[[e["dev_loss"] for e in r["epochs"]] for r in mine["none"]])]
        turn = min(range(len(mean_dev)), key=mean_dev.__getitem__)
    last = min(len(r["epochs"]) for rs in mine.values() for r in rs) - 1
    read_at = ([turn] if turn is not None and turn != last else []) + [last]

    def best(run):
        return min(run["epochs"], key=lambda e: e["dev_loss"])

    head = ["strategy", "seeds", "best dev loss", "its epoch, by seed"]
    if any("dev_acc" in r["epochs"][0] for rs in mine.values() for r in rs):
        head.append("dev acc. there")
    head.append(f"dev loss, epoch {last + 1}")
    for _, label in train_panels:
        head += [f"{label}, epoch {i + 1}" for i in read_at]
    head.append("drop rate")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for strategy, rs in mine.items():
        cells = [strategy, str(len(rs)), _mean_std_text([best(r)["dev_loss"] for r in rs], 3)]
        cells.append(", ".join(str(best(r)["epoch"]) for r in rs))
        if "dev acc. there" in head:
            cells.append(_mean_std_text([best(r)["dev_acc"] for r in rs], 3))
        cells.append(_mean_std_text([r["epochs"][last]["dev_loss"] for r in rs], 3))
        for key, _ in train_panels:
            cells += [_mean_std_text([r["epochs"][i][key] for r in rs], 3) for i in read_at]
        cells.append(f"{statistics.fmean(e['drop_rate'] for r in rs for e in r['epochs']):.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    if "none" in mine and len(mine) > 1:
        lines += ["", "| strategy − none, paired by seed | pairs | best dev loss | p | last dev loss | p |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for strategy, rs in mine.items():
            if strategy == "none":
                continue
            diffs = [
                paired_difference({r["seed"]: measure(r) for r in rs}, {r["seed"]: measure(r) for r in mine["none"]})
                for measure in (lambda r: best(r)["dev_loss"], lambda r: r["epochs"][last]["dev_loss"])
            ]
            if diffs[0] is None:  # no seed in common with none
                continue
            cells = [f"{strategy} − none", str(diffs[0]["pairs"])]
            for diff in diffs:
                std = "" if diff["std_diff"] is None else f" ± {diff['std_diff']:.3f}"
                cells += [f"{diff['mean_diff']:+.3f}{std}", "-" if diff["p"] is None else f"{diff['p']:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: Dict, path: Path, title: str, panels) -> None:
    """One panel per (measure, label[, first epoch]), mean over seeds with a lowest-to-highest band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label, *first) in zip(axes, panels):
        for strategy, s in summary.items():
            draw_band(ax, **s[key], first=first[0] if first else 1, label=seeds_label(strategy, s["seeds"]))
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("hf", "fairseq"), default="hf")
    ap.add_argument("--train", type=Path, default=MOVIE_REVIEWS / "train.jsonl")
    ap.add_argument("--dev", type=Path, default=MOVIE_REVIEWS / "dev.jsonl")
    ap.add_argument("--model", help="a transformers classifier folder (default: the offline MiniLM)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--train-size", type=int, default=400)
    ap.add_argument("--dev-size", type=int, default=500, help="dev examples scored after every epoch (0: all)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=None, help="default: outputs/fig2/minilm or outputs/fig2/fairseq")
    fs = ap.add_argument_group("fairseq backend")
    fs.add_argument("--mt-data", type=Path, default=MT_CORPUS, help="folder with {train,valid,test}.{en,ro}")
    fs.add_argument("--vocab-size", type=int, default=2000)
    fs.add_argument("--dropout", type=float, default=0.3, help="the Transformer's dropout (the demo's 0.3)")
    fs.add_argument(
        "--warmup-updates",
        type=int,
        default=50,
        help="learning-rate warm-up (the demo's 300 updates are 10 epochs of 1,000 pairs)",
    )
    opts = ap.parse_args(argv)
    if opts.out_dir is None:
        opts.out_dir = Path("outputs/fig2") / ("minilm" if opts.backend == "hf" else "fairseq")
    try:
        opts.strategies = comma_list("--strategies", opts.strategies, accepted=STRATEGIES)
        opts.seeds = comma_list("--seeds", opts.seeds, minimum=0)
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    for name, minimum in (("train_size", 2), ("dev_size", 0), ("epochs", 1), ("batch_size", 1), ("max_length", 8)):
        if getattr(opts, name) < minimum:
            ap.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(opts, name)}")
    if not opts.lr > 0:
        ap.error(f"--lr must be > 0, got {opts.lr}")
    if opts.warmup_updates < 1:
        ap.error(f"--warmup-updates must be >= 1, got {opts.warmup_updates}")
    if not 0.0 <= opts.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {opts.dropout}")
    outputs = [("--out-dir", opts.out_dir / name) for name in ("runs.jsonl", "results.json", "results.md", "fig2.png")]
    if opts.backend == "fairseq":
        opts.mt_data = checkout_data(opts.mt_data, "--mt-data")
        outputs.append(("--out-dir", opts.out_dir / "data"))  # the subset, its sentencepiece model and data-bin
        inputs = [
            ("--mt-data", opts.mt_data / f"{split}.{lang}")
            for split in ("train", "valid", "test")
            for lang in ("en", "ro")
        ]
    else:
        opts.train = checkout_data(opts.train, "--train")
        opts.dev = checkout_data(opts.dev, "--dev")
        inputs = [("--train", opts.train), ("--dev", opts.dev)]
    try:
        check_outputs_spare_inputs(outputs, inputs)
    except OutputOverwritesInputError as err:
        ap.error(str(err))
    return opts


def _hf_setup(opts):
    """Data and tokenizer of the MiniLM runs, loaded once; returns (strategy, seed) -> run."""
    try:
        train_examples = load_jsonl(opts.train)
        dev_examples = load_jsonl(opts.dev)
    except DataError as err:
        print(f"attn-reg-fig2: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if opts.train_size > len(train_examples):
        print(f"attn-reg-fig2: --train-size {opts.train_size} > the {len(train_examples)} examples", file=sys.stderr)
        raise SystemExit(2)
    if opts.model is None:
        opts.model = require_minilm("attn-reg-fig2 --model")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model)
    if opts.dev_size:
        dev_examples = dev_examples[: opts.dev_size]
    dev_batches = eval_batches(tokenizer, encode(tokenizer, dev_examples, opts.max_length), 64)
    return lambda strategy, seed: run_one(opts, strategy, seed, tokenizer, train_examples, dev_batches)


def settings(opts) -> Dict:
    if opts.backend == "fairseq":
        keys = ("backend", "train_size", "epochs", "vocab_size", "dropout", "warmup_updates")
        return {**{k: getattr(opts, k) for k in keys}, "mt_data": str(opts.mt_data), "p": P, "q": Q}
    keys = ("train_size", "dev_size", "epochs", "batch_size", "lr", "max_length")
    return {
        **{k: getattr(opts, k) for k in keys},
        "train": str(opts.train),
        "dev": str(opts.dev),
        "model": opts.model,
        "p": P,
        "q": Q,
    }


def main(argv=None) -> int:
    opts = parse_args(argv)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    if opts.backend == "fairseq":
        from . import mt_pipeline as mt

        data_bin = mt.prepare_subset(
            opts.mt_data,
            opts.out_dir / "data",
            {"train": opts.train_size},
            opts.vocab_size,
            log=lambda line: print("  " + line, flush=True),
        )

        def train_one(strategy, seed):
            return run_one_fairseq(opts, strategy, seed, data_bin)

        title = f"AD-DROP Fig. 2: fairseq Transformer, {opts.train_size} EN-RO pairs, encoder layer 1"
        panels = [("train_loss", "train loss (running, under dropping; base 2)"), ("dev_loss", "valid loss (base 2)")]
        late = zoom_start(opts.epochs)
        if late:
            panels.append(("dev_loss", f"valid loss from epoch {late} (base 2)", late))
    else:
        train_one, title = _hf_setup(opts), f"AD-DROP Fig. 2: MiniLM, {opts.train_size} movie reviews, layer 1"
        panels = [
            ("running_loss", "train loss (running, under dropping)"),
            ("train_loss", "train loss (eval mode, nothing dropped)"),
            ("dev_loss", "dev loss"),
        ]
    runs_file = opts.out_dir / "runs.jsonl"
    config = settings(opts)
    done = finished_runs(runs_file, config, lambda run: (run["strategy"], run["seed"]), "attn-reg-fig2")
    runs = []
    for seed in opts.seeds:
        for strategy in opts.strategies:
            if (strategy, seed) in done:
                runs.append(done[(strategy, seed)])
                continue
            run = train_one(strategy, seed)
            runs.append(run)
            record_run(runs_file, config, run)
            last = run["epochs"][-1]
            best = min(run["epochs"], key=lambda e: e["dev_loss"])
            print(
                f"{strategy} seed {seed}: final train loss {last['train_loss']:.4f}, dev loss {last['dev_loss']:.4f} "
                f"(best {best['dev_loss']:.4f} at epoch {best['epoch']}), {run['train_seconds']} s",
                flush=True,
            )
    summary = summarize(runs, opts.strategies, opts.epochs)
    result = {"environment": environment(), "settings": config, "summary": summary, "runs": runs}
    (opts.out_dir / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    plot(summary, opts.out_dir / "fig2.png", title, panels)
    table = markdown(runs, opts.strategies, [p for p in panels if p[0] != "dev_loss"])
    (opts.out_dir / "results.md").write_text(table, encoding="utf-8")
    print(table)
    print(f"wrote {opts.out_dir / 'results.json'}, results.md and fig2.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
