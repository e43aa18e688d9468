"""The fairseq workload: a Transformer on a batch of the shipped EN-RO corpus, fairseq-train's update."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, Optional

import torch

from attn_reg_plugin.user_dir import FAIRSEQ_USER_DIR

from ..paths import MT_CORPUS as CORPUS
from ..paths import checkout_data
from .measure import held_bytes
from .variants import Step, idle_config

FAIRSEQ_QUICK = [
    "--arch",
    "transformer",
    "--share-all-embeddings",
    "--encoder-layers",
    "2",
    "--decoder-layers",
    "2",
    "--encoder-embed-dim",
    "32",
    "--decoder-embed-dim",
    "32",
    "--encoder-ffn-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "64",
    "--encoder-attention-heads",
    "2",
    "--decoder-attention-heads",
    "2",
]


def corpus_dir(work_dir: Path, quick: bool) -> Path:
    """The folder under ``work_dir`` that caches the prepared corpus (raw cut, spm/, data-bin/)."""
    return Path(work_dir) / ("gettext_en_ro_quick" if quick else "gettext_en_ro_sp2000")


def prepare_corpus(work_dir: Path, quick: bool, log) -> Path:
    """Sentencepiece + fairseq-preprocess of the shipped corpus, cached under ``work_dir``."""
    from .. import mt_pipeline as mt

    root = corpus_dir(work_dir, quick)
    data_bin = root / "data-bin"
    if (data_bin / "dict.en.txt").exists() and (data_bin / "train.en-ro.en.bin").exists():
        return data_bin
    raw = checkout_data(CORPUS, "a checkout (the shipped EN-RO corpus)")
    if quick:  # a cut of the same corpus: enough for batches, seconds to prepare
        raw = root / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", 400), ("valid", 100), ("test", 100)):
            for lang in ("en", "ro"):
                lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
                (raw / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    root.mkdir(parents=True, exist_ok=True)
    return mt.prepare_data(raw, root, "en", "ro", vocab_size=300 if quick else 2000, log=log)


def median_length_batch(task, split: str, max_tokens: int, max_positions):
    """The batch of median source length among the split's batches of ``max_tokens``.

    fairseq groups sentences of similar length; the median one is a typical batch, not the
    longest or the shortest.
    """
    from fairseq.utils import resolve_max_positions

    task.load_dataset(split)
    # Sentences longer than the batch budget are skipped, as fairseq-train does with its filters.
    max_positions = resolve_max_positions(max_positions, (max_tokens, max_tokens))
    itr = task.get_batch_iterator(
        task.dataset(split),
        max_tokens=max_tokens,
        max_positions=max_positions,
        ignore_invalid_inputs=True,
        required_batch_size_multiple=8 if split == "train" else 1,
        seed=1,
    )
    batches = list(itr.next_epoch_itr(shuffle=False))
    batches.sort(key=lambda s: (s["net_input"]["src_tokens"].shape[1], s["ntokens"]))
    return batches[len(batches) // 2]


def _describe_sample(sample) -> str:
    src = sample["net_input"]["src_tokens"]
    return f"{src.shape[0]} sentences, {src.shape[1]} src x {sample['target'].shape[1]} tgt positions, {sample['ntokens']} target tokens"


class FairseqBench:
    """A fairseq Transformer built in-process exactly as fairseq-train builds it, with the plugin's task."""

    framework = "fairseq"

    def __init__(self, opts, log):
        import fairseq  # noqa: F401  (before the plugin: registration needs fairseq loaded)
        from fairseq import optim, options, tasks, utils
        from fairseq.dataclass.configs import GenerationConfig
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        import attn_reg_plugin.fairseq_plugin  # noqa: F401
        from attn_reg_plugin.fairseq_plugin.attention import RegularizedMultiheadAttention

        self.opts = opts
        self.device = opts.device
        self.utils = utils
        data_bin = prepare_corpus(Path(opts.work_dir), opts.quick, log)
        precision = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[opts.dtype]
        argv = [
            str(data_bin),
            "--user-dir",
            FAIRSEQ_USER_DIR,
            "--task",
            "attn_reg_translation",
            *(FAIRSEQ_QUICK if opts.quick else ["--arch", opts.fairseq_arch, "--share-all-embeddings"]),
            "--criterion",
            "label_smoothed_cross_entropy",
            "--label-smoothing",
            "0.1",
            "--optimizer",
            "adam",
            "--adam-betas",
            "(0.9, 0.98)",
            "--lr",
            "1e-4",
            "--seed",
            str(opts.seed),
            *precision,
            *(["--cpu"] if opts.device == "cpu" else []),
        ]
        args = options.parse_args_and_arch(options.get_training_parser(), argv)
        cfg = convert_namespace_to_omegaconf(args)
        torch.manual_seed(opts.seed)
        self.cfg = cfg
        self.task = tasks.setup_task(cfg.task)
        model = self.task.build_model(cfg.model)
        self.plain_criterion = self.task.build_criterion(cfg.criterion)
        # fairseq's Trainer: --fp16 / --bf16 train a half-precision model with fp32 master weights.
        if opts.dtype == "fp16":
            model, self.plain_criterion = model.half(), self.plain_criterion.half()
        elif opts.dtype == "bf16":
            model = model.to(dtype=torch.bfloat16)
        self.model = model.to(opts.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = (
            optim.FP16Optimizer.build_optimizer(cfg, params)
            if opts.dtype != "fp32"
            else optim.build_optimizer(cfg.optimizer, params)
        )
        self.regularized_class = RegularizedMultiheadAttention
        self.regularized = [m for m in self.model.modules() if isinstance(m, RegularizedMultiheadAttention)]
        log(
            f"fairseq: {sum(p.numel() for p in params) / 1e6:.1f}M parameters, "
            f"{len(self.regularized)} attention modules routed through the plugin"
        )

        max_positions = utils.resolve_max_positions(self.task.max_positions(), self.model.max_positions())
        train_tokens = opts.fairseq_max_tokens
        self.batches = {
            "train": self._to_device(median_length_batch(self.task, "train", train_tokens, max_positions)),
            "train-small": self._to_device(
                median_length_batch(self.task, "train", opts.fairseq_small_max_tokens, max_positions)
            ),
            "validation": self._to_device(median_length_batch(self.task, "valid", train_tokens, max_positions)),
            "generation": self._to_device(
                median_length_batch(self.task, "test", opts.fairseq_gen_max_tokens, max_positions)
            ),
        }
        self.batch_descriptions = {k: _describe_sample(v) for k, v in self.batches.items()}
        self.tokens = {k: int(v["ntokens"]) for k, v in self.batches.items()}  # target tokens, fairseq's count
        self.batch_descriptions["train"] += f" (--max-tokens {train_tokens})"
        self.batch_descriptions["train-small"] += f" (--max-tokens {opts.fairseq_small_max_tokens})"
        self.batch_descriptions["validation"] += f" (valid split, --max-tokens {train_tokens})"
        # An untrained model rarely emits </s>: bound output length as a trained one's would be.
        gen_cfg = GenerationConfig(beam=5, max_len_a=1.2, max_len_b=10)
        self.batch_descriptions["generation"] += (
            f" (test split, --max-tokens {opts.fairseq_gen_max_tokens}, beam 5, max length 1.2*src+10)"
        )
        self.generator = self.task.build_generator([self.model], gen_cfg)
        self.updates = 0

    def _to_device(self, sample):
        return self.utils.move_to_cuda(sample) if self.device == "cuda" else sample

    def held_bytes(self) -> int:
        return held_bytes(self.model, self.optimizer)

    @contextlib.contextmanager
    def stock_attention(self) -> Iterator[None]:
        """fairseq's own MultiheadAttention class on the same modules and weights (the plain reference)."""
        from fairseq.modules.multihead_attention import MultiheadAttention

        for m in self.regularized:
            m.__class__ = MultiheadAttention
        try:
            yield
        finally:
            for m in self.regularized:
                m.__class__ = self.regularized_class

    # -- training ------------------------------------------------------------------------------
    def train_step(self, criterion, epoch: int, batch: str, stock: bool = False) -> Step:
        """fairseq-train's update: task.train_step (forward + backward), grads / sample size, grad norm, optimizer step."""
        sample = self.batches[batch]

        def prepare(round_index: int) -> None:
            torch.manual_seed(self.opts.seed + round_index)  # as fairseq reseeds every update
            self.optimizer.zero_grad()
            self.task.begin_epoch(epoch, self.model)

        def run() -> None:
            _, sample_size, _ = self.task.train_step(
                sample, self.model, criterion, self.optimizer, update_num=self.updates
            )
            self.optimizer.multiply_grads(1.0 / float(sample_size or 1.0))
            self.optimizer.clip_grad_norm(0.0)  # fairseq-train computes the norm even without clipping
            try:
                # fairseq-train steps through the task: AttendOut's Attacker steps there too.
                self.task.optimizer_step(self.optimizer, self.model, update_num=self.updates)
            except OverflowError:  # fp16 loss-scale overflow: fairseq-train skips the update too
                pass
            self.updates += 1

        return Step(run=run, prepare=prepare, state=self.stock_attention if stock else contextlib.nullcontext)

    def plain_step(self, batch: str) -> Step:
        return self.train_step(self.plain_criterion, epoch=1, batch=batch, stock=True)

    def ad_drop_criterion(self, config):
        from attn_reg_plugin.fairseq_plugin.ad_drop_label_smoothed_cross_entropy import (
            ADDropLabelSmoothedCrossEntropyCriterion,
        )

        criterion = ADDropLabelSmoothedCrossEntropyCriterion(self.task, sentence_avg=False, label_smoothing=0.1)
        criterion.init_ad_drop(self.task, config)
        criterion.attach_attention_sites(self.task.attn_reg_controller)
        return criterion.half() if self.opts.dtype == "fp16" else criterion

    def ad_drop_step(self, config, epoch: int, batch: str) -> Step:
        return self.train_step(self.ad_drop_criterion(config), epoch=epoch, batch=batch, stock=False)

    def criterion_step(self, criterion_class, config_class, config, batch: str) -> Step:
        """A baseline's criterion (R-Drop, HiddenCut) with ``config``'s options, built as fairseq-train builds it
        from its dataclass config."""
        from attn_reg_plugin.core.regularizers.options import attribute_prefix

        prefix = attribute_prefix(type(config))
        options = {prefix + k: v for k, v in dataclasses.asdict(config).items()}
        cfg = config_class(label_smoothing=0.1, **options)
        criterion = criterion_class.build_criterion(cfg, self.task)
        criterion = criterion.half() if self.opts.dtype == "fp16" else criterion
        return self.train_step(criterion, epoch=1, batch=batch, stock=True)

    def rdrop_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.fairseq_plugin.rdrop_label_smoothed_cross_entropy import (
            RDropLabelSmoothedCrossEntropyConfig,
            RDropLabelSmoothedCrossEntropyCriterion,
        )

        return self.criterion_step(
            RDropLabelSmoothedCrossEntropyCriterion, RDropLabelSmoothedCrossEntropyConfig, config, batch
        )

    def hiddencut_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.fairseq_plugin.hiddencut_label_smoothed_cross_entropy import (
            HiddenCutLabelSmoothedCrossEntropyConfig,
            HiddenCutLabelSmoothedCrossEntropyCriterion,
        )

        return self.criterion_step(
            HiddenCutLabelSmoothedCrossEntropyCriterion, HiddenCutLabelSmoothedCrossEntropyConfig, config, batch
        )

    def drophead_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.core.regularizers.drophead import DropHead

        return self.task_regularizer_step("attn_reg_drophead", DropHead(config, self.task.attn_reg_controller), batch)

    def task_regularizer_step(self, attribute: str, regularizer, batch: str, held=None) -> Step:
        """A regularizer of the task wrapper (AttendOut, scheduled dropout, LayerDrop) with the plain criterion."""
        step = self.train_step(self.plain_criterion, epoch=1, batch=batch, stock=False)

        @contextlib.contextmanager
        def state():
            # The task runs its regularizers from attn_reg_active, by their registry key.
            self.task.attn_reg_active = {attribute[len("attn_reg_") :]: regularizer}
            try:
                yield
            finally:
                self.task.attn_reg_active = {}

        step.state, step.held = state, held
        return step

    def scheduled_dropout_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledAttentionDropout

        return self.task_regularizer_step(
            "attn_reg_scheduled_dropout", ScheduledAttentionDropout(config, self.task.attn_reg_controller), batch
        )

    def layerdrop_step(self, config, batch: str) -> Step:
        from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDrop

        return self.task_regularizer_step(
            "attn_reg_layerdrop", AttentionLayerDrop(config, self.task.attn_reg_controller), batch
        )

    def attendout_step(self, config, batch: str) -> Optional[Step]:
        from attn_reg_plugin.core.regularizers.attendout.config import generator_positions
        from attn_reg_plugin.fairseq_plugin.attendout import FairseqAttendOut

        if self.opts.dtype != "fp32":
            return None  # the fairseq adapter trains AttendOut in fp32 only
        task = self.task
        if "valid" not in task.datasets:
            task.load_dataset("valid")
        # As the task sizes it: the generator covers the longest sequence the model takes.
        positions = self.model.max_positions()  # an int or (source, target)
        lengths = [n for n in (positions if isinstance(positions, tuple) else (positions,)) if isinstance(n, int)]
        config = dataclasses.replace(config, max_positions=generator_positions(config, max(lengths, default=None)))
        attendout = FairseqAttendOut(
            config,
            0.0,
            "valid",
            "",
            task.attendout_heldout_logits,
            task.attendout_streams,
            task.attendout_generator_vocab(),
        )

        def held() -> int:
            if attendout.attacker is None:
                return 0
            return held_bytes(attendout.attacker, attendout.attacker_optimizer) + held_bytes(
                attendout.game.generator, attendout.game.optimizer
            )

        return self.task_regularizer_step("attn_reg_attendout", attendout, batch, held=held)

    # -- inference -----------------------------------------------------------------------------
    def validation_step(self, plugin: bool) -> Step:
        sample = self.batches["validation"]
        criterion = self.ad_drop_criterion(idle_config()) if plugin else self.plain_criterion

        def run() -> None:
            self.task.valid_step(sample, self.model, criterion)

        return Step(run=run, state=contextlib.nullcontext if plugin else self.stock_attention)

    def generation_step(self, plugin: bool) -> Step:
        sample = self.batches["generation"]

        def run() -> None:
            self.task.inference_step(self.generator, [self.model], sample)

        return Step(
            run=run,
            prepare=lambda r: self.model.eval(),
            state=contextlib.nullcontext if plugin else self.stock_attention,
        )

    def reference(self, workload: str) -> Step:
        if workload in ("train", "train-small"):
            step = self.plain_step(workload)
        elif workload == "validation":
            step = self.validation_step(plugin=False)
        elif workload == "generation":
            step = self.generation_step(plugin=False)
        else:
            raise ValueError(workload)
        return step
