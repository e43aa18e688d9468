#!/usr/bin/env python
"""Supervised fine-tuning of a decoder-only LM (Llama, Qwen2, Mistral, Gemma, GPT-2): plain vs AD-DROP.

    python examples/decoder_lm/sft.py --model Qwen/Qwen2-0.5B --out outputs/sft-qwen2 --fp16
    python examples/decoder_lm/sft.py --model meta-llama/Llama-3.2-1B --out outputs/sft-llama --lora 16
    python examples/decoder_lm/sft.py --model Qwen/Qwen2-0.5B --out outputs/sft-long --bf16 \
        --gradient-checkpointing --max-length 4096 --batch-size 1

The task is the shipped EN-RO corpus as instructions: the prompt ``Translate to Romanian: <en>``
and a newline, the response the Romanian sentence and the end-of-text token. The causal-LM loss
counts the response only (prompt and padding labels are -100). Each method starts from the same
checkpoint and seed: ``plain`` runs the stock Trainer, ``ad-drop`` ``ADDropTrainer``, whose
``attention="auto"`` is the model's decoder self-attention and whose attribution target is the
negative pseudo-label loss of the response tokens. ``--lora R`` trains peft LoRA adapters of rank
R on the attention projections instead of every weight (``pip install ".[peft]"``). ``--bf16`` /
``--fp16`` train under the Trainer's autocast (bf16 on a machine without CUDA trains on the CPU),
``--gradient-checkpointing`` recomputes each layer in the backward (the regularizers stay exact),
``--max-length`` is the token budget per example. Prints the dev loss per epoch, the AD-DROP rate,
and greedy continuations of a few dev prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/example_support.py
from example_support import (
    add_ad_drop_options,
    check_common_args,
    hf_trainer,
    mean_ad_drop_rate,
    read_parallel,
    train_and_log,
)

PROMPT = "Translate to Romanian: {}\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="hub name or local folder of a causal LM and its tokenizer")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "gettext_en_ro", help="{train,valid}.{en,ro}")
    ap.add_argument("--max-train-samples", type=int, default=2000)
    ap.add_argument("--max-eval-samples", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=128, help="tokens kept per example (prompt + response)")
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    precision = ap.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="mixed precision (autocast) in float16")
    precision.add_argument("--bf16", action="store_true", help="mixed precision (autocast) in bfloat16")
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer in the backward: activation memory for time, at long --max-length",
    )
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on the attention projections; 0 = full fine-tuning")
    ap.add_argument("--samples", type=int, default=3, help="dev prompts continued greedily after training")
    add_ad_drop_options(ap)  # the config's defaults: p = q = 0.2, all decoder layers
    args = ap.parse_args(argv)
    if args.lora < 0 or args.samples < 0:
        ap.error(f"--lora and --samples must be >= 0, got {args.lora}, {args.samples}")
    check_common_args(ap, args, ("max_train_samples", "max_eval_samples", "max_length", "epochs", "lr", "batch_size"))
    return args


def encode(tokenizer, sources: Sequence[str], targets: Sequence[str], max_length: int) -> List[Dict[str, List[int]]]:
    """Prompt + response ids; labels are the ids with the prompt masked (-100)."""
    rows = []
    for src, tgt in zip(sources, targets):
        prompt = tokenizer(PROMPT.format(src), add_special_tokens=False)["input_ids"]
        response = tokenizer(tgt, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + response)[:max_length]
        labels = ([-100] * len(prompt) + response)[:max_length]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


def collate(pad_id: int):
    import torch

    def pad(rows: List[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        out = {}
        for key, fill in (("input_ids", pad_id), ("attention_mask", 0), ("labels", -100)):
            out[key] = torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows])
        return out

    return pad


def load_model(args):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    if args.lora:
        import peft

        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets = [t for t in ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj") if t in names]
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=targets, lora_dropout=0.0)
        )
    return model


def continue_prompts(model, tokenizer, sources: Sequence[str], max_new_tokens: int = 32) -> List[str]:
    import torch

    model.eval()
    outs = []
    for src in sources:
        ids = tokenizer(PROMPT.format(src), add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        outs.append(tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return outs


def run_method(method: str, args, tokenizer, train, dev, dev_sources) -> dict:
    import transformers

    transformers.set_seed(args.seed)
    model = load_model(args)
    trainer = hf_trainer(
        method,
        args,
        args.out / method,
        model=model,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=collate(tokenizer.pad_token_id),
    )
    epochs, seconds = train_and_log(method, trainer, finite=True)
    samples = continue_prompts(trainer.model, tokenizer, dev_sources[: args.samples])
    for src, hyp in zip(dev_sources, samples):
        print(f"[{method}] {src!r} -> {hyp!r}", flush=True)
    return {"method": method, "epochs": epochs, "train_seconds": round(seconds, 1), "samples": samples}


def main(argv=None) -> int:
    import transformers

    args = parse_args(argv)  # bad options fail here, before anything is loaded
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder LMs often have none; padding is masked anyway
    train_src, train_tgt = read_parallel(args.data, "train", "en", "ro", args.max_train_samples)
    dev_src, dev_tgt = read_parallel(args.data, "valid", "en", "ro", args.max_eval_samples)
    train = encode(tokenizer, train_src, train_tgt, args.max_length)
    dev = encode(tokenizer, dev_src, dev_tgt, args.max_length)
    print(
        f"{len(train)} train / {len(dev)} dev examples from {args.data}; model {args.model}"
        f"{f', LoRA rank {args.lora}' if args.lora else ''}",
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_method(m, args, tokenizer, train, dev, dev_src) for m in args.methods]
    print("\n| method | last dev loss | train time (s) | AD-DROP rate (AD-DROP epochs) |\n|---|---|---|---|")
    for r in results:
        rate = mean_ad_drop_rate(r["epochs"])
        print(f"| {r['method']} | {r['epochs'][-1]['eval_loss']:.4f} | {r['train_seconds']:.1f} | {rate} |")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
