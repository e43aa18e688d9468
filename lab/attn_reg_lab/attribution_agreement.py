"""How often a bf16 attribution pass picks the candidates an fp32 pass picks, on the same batches.

AD-DROP uses its attribution only to rank each query row's keys: the candidate region is the
top ceil(p*n) of them. ``--ad-drop-attribution-precision bf16`` is worth recommending only if
that ranking survives bf16 (the bar: >= 0.95 of the fp32 candidates also picked by bf16). For
each batch, both passes run on the same model in eval mode (no hidden dropout), so they differ
by precision alone; the agreement of a layer is the share of the fp32 candidates that bf16 also
picks, over all query rows of the batch. For scale, the same share between two fp32 passes in
training mode under two hidden-dropout draws, which is how much AD-DROP's own pass 1 varies.

    attn-reg-attribution-agreement --fairseq-checkpoint outputs/demo/checkpoints/plain/checkpoint_best.pt \\
        --data-bin outputs/demo/data-bin --hf-model minilm --out outputs/bf16/agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from attn_reg_plugin.core.kernel.rules import candidate_region
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

from .attribution_models import fairseq_translation, hf_classifier
from .paths import MOVIE_REVIEWS, checkout_data, require_minilm
from .provenance import environment

# One batch of work: (attribution forward, its target, the model: frozen, and put in eval or train mode).
Batch = Tuple[Callable[[], object], Callable, torch.nn.Module]


@dataclass
class LayerAgreement:
    site: str
    per_batch: List[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_batch)

    @property
    def worst(self) -> float:
        return min(self.per_batch)


def region_agreement(reference: torch.Tensor, other: torch.Tensor, valid: torch.Tensor, p: float) -> float:
    """Share of ``reference``'s candidate region (top ceil(p*n) keys per row) that ``other``'s also holds.

    Rows whose reference attribution is zero on every valid key are left out: the target does
    not depend on them (in a classifier's last layer, every row but the pooled one), so both
    passes pick the same keys by tie order alone and would inflate the share."""
    valid = valid.expand(reference.shape)
    informative = (reference.abs() * valid).amax(dim=-1, keepdim=True) > 0
    ref = candidate_region(reference, valid, p) & informative
    return float((ref & candidate_region(other, valid, p)).sum()) / max(int(ref.sum()), 1)


def measure(
    controller,
    batches: Iterable[Batch],
    p_values: Sequence[float],
    attention: str = "auto",
    precision: str = "bf16",
    seed: int = 1,
    other_seed: Optional[int] = None,
) -> Dict[float, List[LayerAgreement]]:
    """Per p, per selected site: the agreement of ``precision`` attribution with fp32 attribution, per batch.

    With ``other_seed`` None the model runs in eval mode: no hidden dropout, so the two passes
    differ by precision alone (a seed would not do it: CUDA draws dropout differently per
    dtype). With ``other_seed`` the model runs in training mode, the passes from ``seed`` and
    ``other_seed``: with ``precision`` fp32 this measures how much the dropout draw alone,
    which every AD-DROP step makes afresh, moves the region.
    """
    reference = ADDrop(ADDropConfig(attention=attention, attribution_precision="fp32"), controller)
    tested = ADDrop(ADDropConfig(attention=attention, attribution_precision=precision), controller)
    layers: Dict[float, Dict[str, LayerAgreement]] = {p: {} for p in p_values}
    for forward, target, frozen in batches:
        frozen.train(other_seed is not None)
        found = []
        for ad_drop, state in ((reference, seed), (tested, seed if other_seed is None else other_seed)):
            torch.manual_seed(state)
            result = ad_drop.attributions(forward, target, frozen)
            if result is None:
                raise RuntimeError("the attribution target was not finite on this batch")
            found.append(result)
        (sites, exact, valids), (_, rounded, _) = found
        for p in p_values:
            for site, a, b, v in zip(sites, exact, rounded, valids):
                name = f"{site.kind} {site.layer}"
                layers[p].setdefault(name, LayerAgreement(name, [])).per_batch.append(region_agreement(a, b, v, p))
    return {p: list(rows.values()) for p, rows in layers.items()}


# -- the two models -----------------------------------------------------------------------------------
def fairseq_batches(checkpoint: Path, data_bin: Path, n_batches: int, max_tokens: int, split: str, device: str = "cpu"):
    """A trained fairseq checkpoint (the demo's) and ``n_batches`` batches of ``split``, as fairseq-train batches them."""
    from fairseq import utils

    model, task, criterion = fairseq_translation(checkpoint, data_bin, device)
    task.load_dataset(split)
    itr = task.get_batch_iterator(
        task.dataset(split),
        max_tokens=max_tokens,
        ignore_invalid_inputs=True,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        seed=1,
    )
    samples = []
    for sample in itr.next_epoch_itr(shuffle=False):
        samples.append(utils.move_to_cuda(sample) if device == "cuda" else sample)
        if len(samples) == n_batches:
            break

    def batches():
        for sample in samples:
            yield (
                lambda s=sample: criterion.attribution_forward(model, s),
                criterion.attribution_target(model, sample),
                model,
            )

    return (
        task.attn_reg_controller,
        batches,
        f"{checkpoint} ({len(samples)} {split} batches, --max-tokens {max_tokens})",
    )


def hf_batches(model_dir: str, rows_path: Path, n_batches: int, batch_size: int, device: str = "cpu"):
    """A transformers classifier (MiniLM: pretrained encoder, new 2-class head) on movie-review batches."""
    torch.manual_seed(0)  # the new head
    tokenizer, model, trainer = hf_classifier(model_dir, 2, device)
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def batches():
        for i in range(n_batches):
            picked = [rows[(i * batch_size + j) % len(rows)] for j in range(batch_size)]
            inputs = dict(
                tokenizer(
                    [r["sentence"] for r in picked], padding=True, truncation=True, max_length=128, return_tensors="pt"
                )
            )
            inputs["labels"] = torch.tensor([int(r["label"]) for r in picked])
            inputs = {k: v.to(device) for k, v in inputs.items()}
            forward_inputs = trainer.ad_drop_forward_inputs(model, inputs)
            yield (lambda f=forward_inputs: model(**f), trainer.ad_drop_target(model, inputs), model)

    return trainer.ad_drop_controller, batches, f"{model_dir} ({n_batches} batches of {batch_size} reviews)"


# -- the command --------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--fairseq-checkpoint",
        type=Path,
        help="a fairseq checkpoint trained with --task attn_reg_translation (make demo writes "
        "outputs/demo/checkpoints/plain/checkpoint_best.pt)",
    )
    ap.add_argument("--data-bin", type=Path, help="its binarized data (outputs/demo/data-bin)")
    ap.add_argument("--split", default="valid", help="the fairseq split whose batches are used (default valid)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="fairseq batch size in tokens (default 1024)")
    ap.add_argument("--hf-model", help="a transformers model folder, or 'minilm' for the offline MiniLM")
    ap.add_argument(
        "--reviews",
        type=Path,
        default=MOVIE_REVIEWS / "train.jsonl",
        help="jsonl rows with 'sentence' and 'label' for the HF model (default: the shipped reviews)",
    )
    ap.add_argument("--batch-size", type=int, default=32, help="HF batch size (default 32)")
    ap.add_argument("--batches", type=int, default=8, help="batches per model (default 8)")
    ap.add_argument("--p", default="0.1,0.2,0.3,0.5", help="comma list of candidate-region sizes p in (0, 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        args.p = [float(x) for x in args.p.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--p must be a comma list of numbers in (0, 1), got {args.p!r}")
    if not args.p or not all(0.0 < p < 1.0 for p in args.p):
        ap.error(f"--p must be a comma list of numbers in (0, 1), got {args.p!r}")
    for name in ("batches", "batch_size", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(args, name)}")
    if (args.fairseq_checkpoint is None) != (args.data_bin is None):
        ap.error("--fairseq-checkpoint and --data-bin go together")
    if args.fairseq_checkpoint is None and args.hf_model is None:
        ap.error("give --fairseq-checkpoint with --data-bin, --hf-model, or both")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.hf_model == "minilm":
        args.hf_model = require_minilm("--hf-model minilm")
    try:  # the JSON is written last: it must not replace the checkpoint, a data-bin file or the reviews
        check_outputs_spare_inputs(
            [("--out", args.out)],
            [
                ("--fairseq-checkpoint", args.fairseq_checkpoint),
                ("--data-bin", args.data_bin),
                ("--hf-model", args.hf_model),
                ("--reviews", args.reviews if args.hf_model is not None else None),
            ],
        )
    except OutputOverwritesInputError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = []
    if args.fairseq_checkpoint is not None:
        models.append(
            (
                "fairseq",
                fairseq_batches(
                    args.fairseq_checkpoint, args.data_bin, args.batches, args.max_tokens, args.split, args.device
                ),
            )
        )
    if args.hf_model is not None:
        models.append(
            (
                "hf",
                hf_batches(
                    args.hf_model, checkout_data(args.reviews, "--reviews"), args.batches, args.batch_size, args.device
                ),
            )
        )
    rows = []
    for framework, (controller, batches, description) in models:
        print(f"{framework}: {description}", flush=True)
        bf16 = measure(controller, batches(), args.p)
        # For scale: fp32 against fp32 under another hidden-dropout draw, which every AD-DROP step sees.
        draw = measure(controller, batches(), args.p, precision="fp32", other_seed=2)
        for p in args.p:
            for layer, other in zip(bf16[p], draw[p]):
                rows.append(
                    dict(
                        framework=framework,
                        model=description,
                        p=p,
                        site=layer.site,
                        mean=round(layer.mean, 4),
                        worst=round(layer.worst, 4),
                        other_dropout_draw=round(other.mean, 4),
                        batches=len(layer.per_batch),
                    )
                )
    print(
        "| model | p | site | bf16 vs fp32: mean | worst batch | fp32 vs fp32, other dropout draw: mean |\n"
        "|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['framework']} | {r['p']} | {r['site']} | {r['mean']:.4f} | {r['worst']:.4f} | "
            f"{r['other_dropout_draw']:.4f} |"
        )
    for framework in dict.fromkeys(r["framework"] for r in rows):
        for p in args.p:
            mine = [r for r in rows if r["framework"] == framework and r["p"] == p]
            print(
                f"{framework} p={p}: bf16 vs fp32 mean over layers {statistics.fmean(r['mean'] for r in mine):.4f}, "
                f"worst layer-batch {min(r['worst'] for r in mine):.4f}; another dropout draw "
                f"{statistics.fmean(r['other_dropout_draw'] for r in mine):.4f}"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return rows


def command(argv=None) -> int:
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(command())
