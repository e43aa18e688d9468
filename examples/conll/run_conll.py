#!/usr/bin/env python
"""CoNLL-2003 NER with transformers: token classification, plain vs AD-DROP, entity-level F1.

    python examples/conll/run_conll.py --model bert-base-cased --out outputs/conll
    python examples/conll/run_conll.py --model PATH --train-file train.jsonl --validation-file dev.jsonl --out OUT

Data: ``datasets.load_dataset("conll2003")`` (train, validation as dev; its ``tokens`` and
``ner_tags``), or local JSON-lines files, one sentence per line:
``{"tokens": ["Angela", "Merkel", "visited", "Paris", "."], "ner_tags": ["B-PER", "I-PER", "O", "B-LOC", "O"]}``
with tags from CoNLL-2003's nine (``O``, ``B-``/``I-`` of PER, ORG, LOC, MISC).

Words are split into word pieces; a word's tag goes on its first piece, the other pieces and
special tokens get -100 (ignored by the loss, by the AD-DROP target and by scoring). The
AD-DROP target is minus the pseudo-label token loss over the labelled pieces. The dev score is
strict entity-level micro F1 (an entity counts when its type and span match exactly, as in
conlleval), computed every epoch; the best epoch is reported.

The paper's CoNLL-2003 hyper-parameters are in its Appendix A, which our copy lacks: learning
rate 2e-5, batch size 32, 5 epochs, AD-DROP in all layers with p = q = 0.3 are our defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Set, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/example_support.py
from example_support import (
    add_ad_drop_options,
    check_common_args,
    hf_trainer,
    read_jsonl,
    train_and_log,
)

# The label order of the hub's conll2003 ner_tags feature.
CONLL_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
# Tokenizers that need add_prefix_space=True to take pre-split words (byte-level BPE).
PREFIX_SPACE_MODELS = ("roberta", "longformer", "bart", "gpt2", "deberta")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="bert-base-cased", help="hub name or folder (BERT, RoBERTa, ELECTRA, ...)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dataset", default="conll2003", help="hub dataset name for datasets.load_dataset")
    ap.add_argument("--train-file", type=Path, default=None, help="local JSON lines instead of the hub's train split")
    ap.add_argument(
        "--validation-file", type=Path, default=None, help="local JSON lines instead of the hub's validation"
    )
    ap.add_argument("--max-train-samples", type=int, default=None)
    ap.add_argument("--max-eval-samples", type=int, default=None)
    ap.add_argument("--epochs", type=float, default=5)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=256, help="word pieces per sentence; longer ones are an error")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--fp16", action="store_true")
    add_ad_drop_options(ap, p=0.3, q=0.3)
    args = ap.parse_args(argv)
    if (args.train_file is None) != (args.validation_file is None):
        ap.error("--train-file and --validation-file go together")
    check_common_args(ap, args, ("max_train_samples", "max_eval_samples", "epochs", "lr", "batch_size", "max_length"))
    return args


def check_sentence(
    row: dict, labels: Sequence[str], where: str, tags_are_ids: bool = False
) -> Tuple[List[str], List[int]]:
    """(tokens, tag ids): non-empty, equal lengths, every tag in ``labels``; else ValueError naming ``where``."""
    tokens, tags = row.get("tokens"), row.get("ner_tags")
    if not isinstance(tokens, list) or not isinstance(tags, list):
        raise ValueError(f"{where}: needs lists 'tokens' and 'ner_tags'")
    if not tokens:
        raise ValueError(f"{where}: empty sentence (no tokens)")
    if len(tokens) != len(tags):
        raise ValueError(f"{where}: {len(tokens)} tokens but {len(tags)} ner_tags")
    for i, token in enumerate(tokens):
        if not isinstance(token, str) or not token.strip():
            raise ValueError(f"{where}: token {i} is empty or not a string: {token!r}")
    ids = []
    for i, tag in enumerate(tags):
        if tags_are_ids:
            ok = isinstance(tag, int) and not isinstance(tag, bool) and 0 <= tag < len(labels)
            ids.append(tag)
        else:
            ok = isinstance(tag, str) and tag in labels
            ids.append(labels.index(tag) if ok else -1)
        if not ok:
            raise ValueError(
                f"{where}: tag {i} ({tag!r}, token {tokens[i]!r}) is not in the label set {', '.join(labels)}"
            )
    return tokens, ids


def load_split(args, split: str, load_dataset=None) -> Tuple[List[Tuple[List[str], List[int]]], List[str]]:
    """("train" | "dev") sentences as (tokens, tag ids), and the label names."""
    limit = args.max_train_samples if split == "train" else args.max_eval_samples
    path = args.train_file if split == "train" else args.validation_file
    if path is not None:
        labels = list(CONLL_LABELS)
        rows = [check_sentence(row, labels, f"{path}:{number}") for number, row in read_jsonl(path)]
        return (rows[:limit] if limit is not None else rows), labels
    if load_dataset is None:
        from datasets import load_dataset
    hub_split = "train" if split == "train" else "validation"
    data = load_dataset(args.dataset)[hub_split]
    labels = list(data.features["ner_tags"].feature.names)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    where = f"{args.dataset} {hub_split} row"
    return [check_sentence(row, labels, f"{where} {i}", tags_are_ids=True) for i, row in enumerate(data)], labels


def align_labels(tokenizer, sentences, max_length: int, where: str) -> List[dict]:
    """Word pieces with the word's tag on its first piece and -100 elsewhere (fast tokenizers' word_ids)."""
    if not tokenizer.is_fast:
        raise ValueError("token classification needs a fast tokenizer (word_ids); this model's tokenizer is not one")
    features = []
    for index, (tokens, tags) in enumerate(sentences):
        enc = tokenizer(tokens, is_split_into_words=True)
        if len(enc["input_ids"]) > max_length:
            raise ValueError(
                f"{where} sentence {index}: {len(enc['input_ids'])} word pieces exceed --max-length "
                f"{max_length}; raise it rather than lose labelled words"
            )
        labels, previous = [], None
        for word in enc.word_ids():
            labels.append(-100 if word is None or word == previous else tags[word])
            previous = word
        features.append(dict(enc, labels=labels))
    return features


def entity_spans(tags: Sequence[str]) -> Set[Tuple[int, int, str]]:
    """(start, end, type) of each entity in an IOB1/IOB2 tag sequence, conlleval's chunking.

    An entity starts at ``B-X``, or at ``I-X`` not continuing an ``X`` entity; ``I-X`` continues it.
    """
    spans, start, kind = set(), None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, tag_kind = tag.partition("-")
        if start is not None and not (prefix == "I" and tag_kind == kind):
            spans.add((start, i, kind))
            start = kind = None
        if prefix in ("B", "I") and start is None:
            start, kind = i, tag_kind
    return spans


def entity_f1(predicted: Sequence[Sequence[str]], gold: Sequence[Sequence[str]]) -> Dict[str, float]:
    """Micro precision / recall / F1 over exact (span, type) matches, summed over sentences."""
    hits = n_pred = n_gold = 0
    for p, g in zip(predicted, gold):
        ps, gs = entity_spans(p), entity_spans(g)
        hits, n_pred, n_gold = hits + len(ps & gs), n_pred + len(ps), n_gold + len(gs)
    precision = hits / n_pred if n_pred else 0.0
    recall = hits / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def compute_metrics_for(labels: Sequence[str]):
    def compute(eval_pred) -> Dict[str, float]:
        logits = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        pred, gold = np.asarray(logits).argmax(-1), np.asarray(eval_pred.label_ids)
        keep = gold != -100
        pred_tags = [[labels[t] for t in row[k]] for row, k in zip(pred, keep)]
        gold_tags = [[labels[t] for t in row[k]] for row, k in zip(gold, keep)]
        scores = entity_f1(pred_tags, gold_tags)
        scores["token_accuracy"] = float((pred[keep] == gold[keep]).mean()) if keep.any() else 0.0
        return scores

    return compute


def run_method(method: str, args, train, dev, labels: List[str]) -> dict:
    import transformers

    transformers.set_seed(args.seed)
    config = transformers.AutoConfig.from_pretrained(
        args.model,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={t: i for i, t in enumerate(labels)},
    )
    extra = {"add_prefix_space": True} if config.model_type in PREFIX_SPACE_MODELS else {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, **extra)
    model = transformers.AutoModelForTokenClassification.from_pretrained(args.model, config=config)
    trainer = hf_trainer(
        method,
        args,
        args.out / method,
        model=model,
        train_dataset=align_labels(tokenizer, train, args.max_length, "train"),
        eval_dataset=align_labels(tokenizer, dev, args.max_length, "dev"),
        data_collator=transformers.DataCollatorForTokenClassification(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics_for(labels),
    )
    epochs, seconds = train_and_log(method, trainer, "f1")
    best = max(epochs, key=lambda row: row.get("eval_f1", -math.inf))
    return {
        "method": method,
        "epochs": epochs,
        "best_epoch": best["epoch"],
        "best_dev_f1": best.get("eval_f1"),
        "train_seconds": round(seconds, 1),
    }


def main(argv=None, load_dataset=None) -> int:
    args = parse_args(argv)
    (train, labels), (dev, _) = load_split(args, "train", load_dataset), load_split(args, "dev", load_dataset)
    print(f"{len(train)} train / {len(dev)} dev sentences, labels {' '.join(labels)}; model {args.model}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_method(method, args, train, dev, labels) for method in args.methods]
    print("\n| method | best dev entity F1 | epoch | train time (s) |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['method']} | {r['best_dev_f1']:.4f} | {r['best_epoch']} | {r['train_seconds']:.1f} |")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
