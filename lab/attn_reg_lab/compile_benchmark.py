"""Step time of every Hugging Face trainer with ``torch_compile=True`` against eager, on MiniLM.

For each trainer (plain Trainer, AD-DROP GA, AttendOut, scheduled dropout, LayerDrop) it runs
the real ``Trainer.train()`` twice on the pretrained MiniLM classifier (6 layers, 384 wide) and
the shipped movie reviews padded to a fixed length, once eager and once compiled, and reports:
the first step (the compiled run's includes compiling), the median step after the warm-up, the
dynamo graphs compiled and graph breaks. Used for docs/PERFORMANCE.md "torch.compile":

    attn-reg-compile-benchmark --out outputs/compile_benchmark.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch._dynamo.utils import counters

from .paths import MOVIE_REVIEWS, checkout_data, require_minilm
from .provenance import environment


def minilm_path() -> str:
    return require_minilm("the compile benchmark")


def rows(tokenizer, split: str, n: int, length: int):
    lines = (
        (checkout_data(MOVIE_REVIEWS, "a checkout (the shipped movie reviews)") / f"{split}.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()[:n]
    )
    out = []
    for line in lines:
        record = json.loads(line)
        enc = tokenizer(record["sentence"], padding="max_length", truncation=True, max_length=length)
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": record["label"]})
    return out


def build(name, common, heldout):
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
    from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
    from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
    from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
    from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer

    if name == "plain":
        return transformers.Trainer(**common)
    if name == "ad-drop-ga":
        return ADDropTrainer(**common, ad_drop=ADDropConfig(schedule="always"))
    if name == "attendout":
        return AttendOutTrainer(**common, eval_dataset=heldout, attendout=AttendOutConfig(dropout_step=5))
    if name == "scheduled-dropout":
        return AttnRegTrainer(**common, scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.3,100:0.1"))
    if name == "layerdrop":
        return AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=0.2))
    raise ValueError(name)


class StepTimes(transformers.TrainerCallback):
    def __init__(self):
        self.times, self.graphs, self._start = [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)
        self.graphs.append(counters["stats"]["unique_graphs"])


def measure(name: str, compiled: bool, opts, tokenizer) -> dict:
    torch._dynamo.reset()
    counters.clear()
    extra = dict(torch_compile=True, torch_compile_backend=opts.backend) if compiled else {}
    args = transformers.TrainingArguments(
        output_dir=str(Path("outputs") / "compile_benchmark" / name),
        use_cpu=True,
        report_to=[],
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch_size,
        logging_steps=opts.steps,
        save_strategy="no",
        seed=1,
        disable_tqdm=True,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    common = dict(
        model=model, args=args, train_dataset=rows(tokenizer, "train", opts.steps * opts.batch_size, opts.length)
    )
    trainer = build(name, common, rows(tokenizer, "dev", 16, opts.length))
    timer = StepTimes()
    trainer.add_callback(timer)
    trainer.train()
    steady = timer.times[opts.warmup :]
    return {
        "trainer": name,
        "compiled": compiled,
        "first_step_s": round(timer.times[0], 3),
        "steady_step_s": round(statistics.median(steady), 4),
        "steps": len(timer.times),
        "graphs": timer.graphs[-1],
        "graphs_after_warmup": timer.graphs[-1] - timer.graphs[opts.warmup - 1],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainers", default="plain,ad-drop-ga,attendout,scheduled-dropout,layerdrop")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=6, help="steps excluded from the steady-state median")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="every batch is padded to this many tokens")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)
    if not 0 < opts.warmup < opts.steps:
        parser.error(f"--warmup must be in [1, --steps), got {opts.warmup}")
    torch.set_num_threads(opts.threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    results = []
    for name in opts.trainers.split(","):
        for compiled in (False, True):
            r = measure(name, compiled, opts, tokenizer)
            results.append(r)
            print(json.dumps(r), flush=True)
    eager = {r["trainer"]: r for r in results if not r["compiled"]}
    print(
        "\n| trainer | eager step (s) | compiled step (s) | speed-up | compiled first step (s) | graphs | after warm-up | graph breaks |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["compiled"]:
            e = eager[r["trainer"]]
            print(
                f"| {r['trainer']} | {e['steady_step_s']:.3f} | {r['steady_step_s']:.3f} | "
                f"{e['steady_step_s'] / r['steady_step_s']:.2f}x | {r['first_step_s']:.1f} | {r['graphs']} | "
                f"{r['graphs_after_warmup']} | {r['graph_breaks']} |"
            )
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(
            json.dumps({"options": vars(opts), "environment": environment(), "results": results}, indent=1),
            encoding="utf-8",
        )


if __name__ == "__main__":
    sys.exit(main())
