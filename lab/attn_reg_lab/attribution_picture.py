"""What AD-DROP does to one sentence (the paper's Fig. 1): attention, attribution, candidates, drops.

    attn-reg-attribution-picture --fairseq-checkpoint outputs/demo/checkpoints/plain/checkpoint_best.pt \\
        --data-bin outputs/demo/data-bin --sentence "Open the file" --layer 1 --head 0 --out outputs/fig1/demo
    attn-reg-attribution-picture --hf-model minilm --sentence "a gripping, well acted film" --out outputs/fig1/minilm

For one attention map (a layer and head of one attention kind) it draws four panels side by
side and writes the same numbers as JSON: the attention weights; the attribution AD-DROP ranks
keys by (``--attribution``: ga, iga or aa; gradient of the pseudo-label target as in training);
the candidate region, each query row's top ceil(p*n) keys; and one draw of the dropped
positions (each candidate with probability q, seeded by ``--seed``). The model runs in eval mode
(no hidden dropout), so the picture is the same on every run.

A fairseq model translates: the sentence is encoded with the data's sentencepiece model (by
default ``<data-bin>/../spm/spm.model``, where the demo puts it) and the decoder is fed
``--target`` or, without it, the model's own greedy translation; the target is the
pseudo-label token loss. A transformers model classifies: its pseudo-label logit is the
target (an encoder without a trained head, such as the offline MiniLM, gets a new 2-class head
from ``--seed``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from attn_reg_plugin.core.kernel.rules import MapScores, TopRegionRule, candidate_region
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs

from .attribution_models import fairseq_translation, hf_classifier
from .paths import require_minilm
from .provenance import environment

KINDS = ("encoder-self", "decoder-self", "encoder-decoder")


class Picture:
    """One model and one input: what a site's attention and attribution are computed from."""

    def __init__(self, controller, forward: Callable[[], object], target, model: torch.nn.Module, tokens: dict):
        self.controller, self.forward, self.target, self.model = controller, forward, target, model
        self.tokens = tokens  # kind -> (query tokens, key tokens)

    def panels(
        self, kind: str, layer: int, head: int, attribution: str, p: float, q: float, seed: int, **options
    ) -> dict:
        """``options``: further ADDropConfig fields (e.g. ``iga_steps``); unset ones keep the config's defaults."""
        config = dict(attention=kind, layers=str(layer), p=p, q=q)
        maps = self._site_values(ADDrop(ADDropConfig(**config, attribution="aa"), self.controller))
        scores = self._site_values(ADDrop(ADDropConfig(**config, attribution=attribution, **options), self.controller))
        attention, valid = maps
        attr, _ = scores
        if not 0 <= head < attention.shape[1]:
            raise ValueError(
                f"--head must be in 0..{attention.shape[1] - 1} (the layer has {attention.shape[1]} heads), got {head}"
            )
        # The kernel's own rule, a call as one block: its region, and its drops from the seed.
        rule = TopRegionRule(MapScores(attr), p, q)
        region = candidate_region(attr, valid, p)
        dropped = rule.whole(valid.expand_as(attr), torch.tensor(seed))
        pick = lambda t: t.expand_as(attention)[0, head].detach().cpu()  # first (only) sentence, one head
        queries, keys = self.tokens[kind]
        return {
            "kind": kind,
            "layer": layer,
            "head": head,
            "attribution_method": attribution,
            "p": p,
            "q": q,
            "seed": seed,
            "queries": queries,
            "keys": keys,
            "attention": pick(attention).tolist(),
            "attribution": pick(attr).tolist(),
            "valid": pick(valid).tolist(),
            "candidates": pick(region).tolist(),
            "dropped": pick(dropped).tolist(),
        }

    def _site_values(self, ad_drop: ADDrop):
        was_training = self.model.training
        self.model.eval()
        try:
            found = ad_drop.attributions(self.forward, self.target, self.model)
        finally:
            self.model.train(was_training)
        if found is None:
            raise RuntimeError("the attribution target is not finite for this input")
        _, (values,), (valid,) = found
        return values.float(), valid


# -- the two kinds of model -------------------------------------------------------------------------
def fairseq_picture(
    checkpoint: Path, data_bin: Path, sentence: str, target: Optional[str], spm_model: Optional[Path]
) -> Picture:
    from fairseq.dataclass.configs import GenerationConfig

    model, task, criterion = fairseq_translation(checkpoint, data_bin)
    model.eval()
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    encode: Callable[[str], str] = lambda text: text  # noqa: E731  (already in the dictionary's units)
    decode: Callable[[str], str] = lambda text: text  # noqa: E731
    if spm_model is not None:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
        encode = lambda text: " ".join(sp.encode(text, out_type=str))  # noqa: E731
        decode = lambda pieces: sp.decode(pieces.split())  # noqa: E731
    src = src_dict.encode_line(encode(sentence), add_if_not_exist=False, append_eos=True).long()
    if (src == src_dict.unk()).any():
        print(f"warning: some of the sentence is unknown to {data_bin}'s dictionary (shown as <unk>)", file=sys.stderr)
    net_input = {"src_tokens": src[None], "src_lengths": torch.tensor([len(src)])}
    if target is None:  # the model's own greedy translation
        generator = task.build_generator([model], GenerationConfig(beam=1, max_len_a=1.5, max_len_b=10))
        hypo = generator.generate([model], {"net_input": net_input})[0][0]
        tgt = hypo["tokens"].long().cpu()
        print(f"translation (greedy): {decode(tgt_dict.string(tgt))}", file=sys.stderr)
    else:
        tgt = tgt_dict.encode_line(encode(target), add_if_not_exist=False, append_eos=True).long()
    prev = torch.cat([torch.tensor([tgt_dict.eos()]), tgt[:-1]])  # teacher forcing, as fairseq's collater shifts
    sample = {"net_input": {**net_input, "prev_output_tokens": prev[None]}, "target": tgt[None], "ntokens": len(tgt)}
    src_tokens = [src_dict[i] for i in src.tolist()]
    tgt_inputs = [tgt_dict[i] for i in prev.tolist()]
    tokens = {
        "encoder-self": (src_tokens, src_tokens),
        "decoder-self": (tgt_inputs, tgt_inputs),
        "encoder-decoder": (tgt_inputs, src_tokens),
    }
    return Picture(
        task.attn_reg_controller,
        lambda: criterion.attribution_forward(model, sample),
        criterion.attribution_target(model, sample),
        model,
        tokens,
    )


def hf_picture(model_dir: str, sentence: str, num_labels: int, seed: int) -> Picture:
    import transformers

    transformers.set_seed(seed)  # a new classifier head, if the folder has none, is drawn from the seed
    tokenizer, model, trainer = hf_classifier(model_dir, num_labels)
    model.eval()
    inputs = dict(tokenizer([sentence], return_tensors="pt"))
    forward_inputs = trainer.ad_drop_forward_inputs(model, inputs)
    words = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    return Picture(
        trainer.ad_drop_controller,
        lambda: model(**forward_inputs),
        trainer.ad_drop_target(model, inputs),
        model,
        {"encoder-self": (words, words)},
    )


# -- drawing ----------------------------------------------------------------------------------------
def draw(numbers: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    valid = torch.tensor(numbers["valid"])
    attribution = torch.tensor(numbers["attribution"]).masked_fill(~valid, float("nan"))
    limit = float(attribution.nan_to_num(0.0).abs().max()) or 1.0
    panels = [
        ("attention weights", torch.tensor(numbers["attention"]), dict(cmap="Blues", vmin=0.0)),
        (f"attribution ({numbers['attribution_method']})", attribution, dict(cmap="RdBu_r", vmin=-limit, vmax=limit)),
        (
            f"candidate region (top {numbers['p']:g} of each row)",
            torch.tensor(numbers["candidates"]).float(),
            dict(cmap="Oranges", vmin=0.0, vmax=1.0),
        ),
        (
            f"dropped (each candidate with q = {numbers['q']:g})",
            torch.tensor(numbers["dropped"]).float(),
            dict(cmap="Reds", vmin=0.0, vmax=1.0),
        ),
    ]
    queries, keys = numbers["queries"], numbers["keys"]
    size = 0.28 * max(len(keys), 6)
    fig, axes = plt.subplots(1, 4, figsize=(4 * size + 2.5, 0.28 * max(len(queries), 6) + 1.8))
    for ax, (name, values, style) in zip(axes, panels):
        image = ax.imshow(values.numpy(), **style)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
        ax.set_yticks(range(len(queries)), queries, fontsize=7)
        ax.set_xlabel("key")
        if name.startswith(("attention", "attribution")):
            fig.colorbar(image, ax=ax, shrink=0.7)
    axes[0].set_ylabel("query")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# -- the command ------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--fairseq-checkpoint", type=Path, help="a translation checkpoint trained with --task attn_reg_translation"
    )
    ap.add_argument("--data-bin", type=Path, help="its binarized data (dictionaries)")
    ap.add_argument(
        "--spm-model",
        type=Path,
        help="sentencepiece model of the data (default <data-bin>/../spm/spm.model "
        "if it exists; without one the sentence is taken as dictionary units)",
    )
    ap.add_argument("--target", help="fairseq: the decoder's input sentence (default: the model's greedy translation)")
    ap.add_argument("--hf-model", help="a transformers model folder, or 'minilm' for the offline MiniLM")
    ap.add_argument("--num-labels", type=int, default=2, help="HF: classes of the head (default 2)")
    ap.add_argument("--sentence", required=True, help="the input sentence")
    ap.add_argument("--attention", default="encoder-self", choices=KINDS)
    ap.add_argument("--layer", type=int, default=0, help="0-based layer of that attention kind (default 0)")
    ap.add_argument("--head", type=int, default=0, help="0-based head (default 0)")
    ap.add_argument("--attribution", default="ga", choices=("ga", "iga", "aa"))
    ap.add_argument("--p", type=float, default=0.3, help="candidate share p in (0, 1) (default 0.3)")
    ap.add_argument("--q", type=float, default=0.3, help="drop probability q in (0, 1) (default 0.3)")
    ap.add_argument("--seed", type=int, default=1, help="the draw of dropped positions (and a new HF head)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.png and OUT.json")
    args = ap.parse_args(argv)
    if (args.fairseq_checkpoint is None) == (args.hf_model is None):
        ap.error("give either --fairseq-checkpoint (with --data-bin) or --hf-model")
    if args.fairseq_checkpoint is not None and args.data_bin is None:
        ap.error("--fairseq-checkpoint needs --data-bin")
    if args.hf_model is not None and args.attention != "encoder-self":
        ap.error("--hf-model: the classifier path draws encoder-self attention only")
    for name in ("p", "q"):
        value = getattr(args, name)
        if not 0.0 < value < 1.0:
            ap.error(f"--{name} must be in the open interval (0, 1), got {value}")
    if args.layer < 0 or args.head < 0:
        ap.error("--layer and --head are 0-based: >= 0")
    if args.hf_model == "minilm":
        args.hf_model = require_minilm("--hf-model minilm")
    if args.data_bin is not None and args.spm_model is None:
        default = args.data_bin.parent / "spm" / "spm.model"
        args.spm_model = default if default.exists() else None
    try:  # OUT.png and OUT.json must not replace the model, its dictionaries or its sentencepiece model
        check_outputs_spare_inputs(
            [("--out", args.out.with_suffix(".png")), ("--out", args.out.with_suffix(".json"))],
            [
                ("--fairseq-checkpoint", args.fairseq_checkpoint),
                ("--data-bin", args.data_bin),
                ("--spm-model", args.spm_model),
                ("--hf-model", args.hf_model),
            ],
        )
    except OutputOverwritesInputError as e:
        ap.error(str(e))
    return ap, args


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    if args.fairseq_checkpoint is not None:
        picture = fairseq_picture(args.fairseq_checkpoint, args.data_bin, args.sentence, args.target, args.spm_model)
        source = str(args.fairseq_checkpoint)
    else:
        picture = hf_picture(args.hf_model, args.sentence, args.num_labels, args.seed)
        source = args.hf_model
    try:
        numbers = picture.panels(args.attention, args.layer, args.head, args.attribution, args.p, args.q, args.seed)
    except ValueError as e:  # a layer or head the model does not have: the message says what it has
        ap.error(str(e))
    numbers.update(model=source, sentence=args.sentence, environment=environment())
    short = "/".join(Path(source).parts[-2:])
    png = draw(
        numbers,
        args.out.with_suffix(".png"),
        f"{short}: {args.attention} layer {args.layer}, head {args.head}\n{args.sentence}",
    )
    args.out.with_suffix(".json").write_text(json.dumps(numbers, indent=1) + "\n", encoding="utf-8")
    dropped = sum(map(sum, numbers["dropped"]))
    print(
        f"{png} and {args.out.with_suffix('.json')}: {sum(map(sum, numbers['candidates']))} candidates, "
        f"{dropped} dropped of {sum(map(sum, numbers['valid']))} attendable positions"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
