"""The transformers workload: the real pretrained MiniLM classifier through the HF adapter."""

from __future__ import annotations

import contextlib
import json
import tempfile
from typing import ContextManager, Iterator, Optional

import torch

from ..paths import TINY_REVIEWS as REVIEWS
from ..paths import checkout_data, require_minilm
from .measure import DTYPES, held_bytes
from .variants import Step, idle_config


def minilm_path() -> str:
    return require_minilm("the MiniLM benchmark (or run it with --frameworks fairseq)")


class HFBench:
    """The real pretrained MiniLM encoder (6 layers, 384 wide) as a 2-class classifier, through the HF adapter."""

    framework = "hf"

    def __init__(self, opts, log):
        import transformers

        from attn_reg_plugin.hf import ADDropTrainer

        self.opts = opts
        self.device = opts.device
        path = opts.hf_model or minilm_path()
        self.tokenizer = tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        torch.manual_seed(opts.seed)
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=2, attn_implementation="sdpa"
        ).to(opts.device)
        rows = [
            json.loads(line)
            for line in checkout_data(REVIEWS, "a checkout (the tiny movie reviews)")
            .read_text(encoding="utf-8")
            .splitlines()
        ]

        def batch(n: int) -> dict:
            picked = (rows * (n // len(rows) + 1))[:n]
            enc = tokenizer(
                [r["sentence"] for r in picked], padding=True, truncation=True, max_length=128, return_tensors="pt"
            )
            enc["labels"] = torch.tensor([r["label"] for r in picked])
            return {k: v.to(opts.device) for k, v in enc.items()}

        self.batches = {
            "train": batch(opts.hf_batch_size),
            "train-small": batch(opts.hf_small_batch_size),
            "validation": batch(opts.hf_batch_size),
        }
        self.tokens = {k: int(v["attention_mask"].sum()) for k, v in self.batches.items()}  # real tokens
        self.batch_descriptions = {
            k: f"{v['input_ids'].shape[0]} sentences x {v['input_ids'].shape[1]} tokens "
            f"(movie reviews, padded to the longest)"
            for k, v in self.batches.items()
        }
        self._tmp = tempfile.TemporaryDirectory(prefix="attn_reg_bench_")
        args = transformers.TrainingArguments(
            output_dir=self._tmp.name,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            use_cpu=opts.device == "cpu",
            seed=opts.seed,
        )
        self.plain_trainer = transformers.Trainer(model=self.model, args=args)
        # Installs the sites and switches the model to "attn_reg"; stock_attention() switches back.
        self.ad_trainer = ADDropTrainer(model=self.model, args=args, ad_drop=idle_config())
        # The Trainer's own optimizer (fused AdamW by default on torch >= 2.8), shared by both trainers.
        self.optimizer = self.plain_trainer.create_optimizer()
        dtype = DTYPES[opts.dtype]
        self.autocast = (
            (lambda: torch.autocast(opts.device, dtype=dtype)) if opts.dtype != "fp32" else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler(opts.device) if opts.dtype == "fp16" else None
        params = sum(p.numel() for p in self.model.parameters())
        log(f"hf: MiniLM {params / 1e6:.1f}M parameters, {len(self.ad_trainer.ad_drop_sites)} attention modules")

    def held_bytes(self) -> int:
        return held_bytes(self.model, self.optimizer)

    def stock_attention(self) -> ContextManager[None]:
        """transformers' own sdpa attention on the same model (the plain reference)."""
        return self.attention("sdpa")

    @contextlib.contextmanager
    def attention(self, implementation: str) -> Iterator[None]:
        """The model on attention ``implementation`` for a while, then back on the plugin's."""
        from attn_reg_plugin.hf.attention import ATTN_IMPLEMENTATION

        self.model.set_attn_implementation(implementation)
        if self.model.config._attn_implementation != implementation:
            raise RuntimeError(f"could not switch the model to attention {implementation!r}")
        try:
            yield
        finally:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def train_step(self, trainer, epoch: int, batch: str, stock: bool = False) -> Step:
        """The Trainer's compute_loss (which AD-DROP wraps), backward, optimizer step."""
        inputs = self.batches[batch]

        def prepare(round_index: int) -> None:
            torch.manual_seed(self.opts.seed + round_index)
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train()
            trainer.state.epoch = float(epoch - 1)  # the Trainer's epoch counter is 0-based and fractional

        def run() -> None:
            with self.autocast():
                loss = trainer.compute_loss(self.model, dict(inputs))
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()

        return Step(run=run, prepare=prepare, state=self.stock_attention if stock else contextlib.nullcontext)

    def ad_drop_step(self, config, epoch: int, batch: str) -> Step:
        from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
        from attn_reg_plugin.core.regularizers.options import named_by_field

        trainer = self.ad_trainer
        ad_drop = ADDrop(named_by_field(config), trainer.ad_drop_controller)
        step = self.train_step(trainer, epoch=epoch, batch=batch)
        inner_prepare = step.prepare

        def prepare(round_index: int) -> None:
            trainer.ad_drop = ad_drop  # the variant's options on the one trainer that owns the sites
            inner_prepare(round_index)

        step.prepare = prepare
        return step

    def attn_reg_step(self, batch: str, **regularizer) -> Step:
        """AttnRegTrainer (scheduled attention dropout or attention LayerDrop): its compute_loss, backward, step."""
        from attn_reg_plugin.hf import AttnRegTrainer

        # A second install on the shared model: the same sites, driven by this trainer's controller too.
        trainer = AttnRegTrainer(model=self.model, args=self.plain_trainer.args, **regularizer)
        step = self.train_step(trainer, epoch=1, batch=batch)
        return step

    def rdrop_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.hf import RDropTrainer

        trainer = RDropTrainer(model=self.model, args=self.plain_trainer.args, rdrop=config)
        return self.train_step(trainer, epoch=1, batch=batch, stock=True)

    def hiddencut_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.hf import HiddenCutTrainer

        with self.stock_attention():  # HiddenCut ranks inside the model's sdpa attention, as a user's model has it
            trainer = HiddenCutTrainer(model=self.model, args=self.plain_trainer.args, hiddencut=config)
            ranked = self.model.config._attn_implementation
        step = self.train_step(trainer, epoch=1, batch=batch)
        step.state = lambda: self.attention(ranked)
        return step

    def attendout_step(self, config, batch: str) -> Optional[Step]:
        """AttendOutTrainer's training_step (Defender and Attacker), D's optimizer step, then A's step and,
        every T updates, the held-out evaluation, Generator update and re-sync (its callback's work)."""
        from attn_reg_plugin.hf import AttendOutTrainer

        if self.opts.dtype == "fp16":
            return None  # AttendOutTrainer refuses fp16 (a skipped D step would desynchronise A)
        inputs = self.batches[batch]
        heldout = [
            {"input_ids": ids[m.bool()].tolist(), "labels": int(label)}
            for ids, m, label in zip(inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(), inputs["labels"].cpu())
        ]
        import transformers

        trainer = AttendOutTrainer(
            model=self.model,
            args=self.plain_trainer.args,
            eval_dataset=heldout,
            data_collator=transformers.DataCollatorWithPadding(self.tokenizer),
            attendout=config,
        )
        trainer.optimizer = self.optimizer
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which is not run here
        # The bench's precision where Trainer(bf16=True) has it: the Trainer's training_step and prediction_step
        # run their forwards inside compute_loss_context_manager, their backward outside (the other steps wrap
        # compute_loss in self.autocast() themselves).
        trainer.compute_loss_context_manager = self.autocast

        def prepare(round_index: int) -> None:
            torch.manual_seed(self.opts.seed + round_index)
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train()

        def run() -> None:
            trainer.training_step(self.model, dict(inputs))
            self.optimizer.step()
            # What Trainer.train() does after each update: the callbacks, AttendOut's among them.
            trainer.callback_handler.on_optimizer_step(trainer.args, trainer.state, trainer.control)
            trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)

        def held() -> int:
            if trainer.attendout_attacker is None:
                return 0
            return held_bytes(trainer.attendout_attacker, trainer.attendout_optimizer) + held_bytes(
                trainer.attendout_generator, trainer.attendout_game.optimizer
            )

        return Step(run=run, prepare=prepare, state=contextlib.nullcontext, held=held)

    def validation_step(self, plugin: bool) -> Step:
        inputs = self.batches["validation"]
        trainer = self.ad_trainer if plugin else self.plain_trainer

        def run() -> None:
            with self.autocast():
                trainer.prediction_step(self.model, dict(inputs), prediction_loss_only=False)

        return Step(
            run=run,
            prepare=lambda r: self.model.eval(),
            state=contextlib.nullcontext if plugin else self.stock_attention,
        )

    def reference(self, workload: str) -> Step:
        if workload in ("train", "train-small"):
            return self.train_step(self.plain_trainer, epoch=1, batch=workload, stock=True)
        if workload == "validation":
            return self.validation_step(plugin=False)
        raise ValueError(workload)
