"""What the benchmark measures: one Variant per regularizer, its builders per framework, its targets."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Sequence


@dataclass
class Step:
    """One variant's unit of work on a workload.

    ``state`` puts the shared model into this variant's configuration (attention class,
    criterion, epoch); ``prepare`` runs before every step (seed, ``zero_grad``). Neither is
    timed: only ``run`` is.
    """

    run: Callable[[], None]
    prepare: Callable[[int], None] = lambda round_index: None
    state: Callable[[], ContextManager] = contextlib.nullcontext
    repeats: Optional[int] = None  # fewer measured repeats than the workload's (very slow variants)
    warmup: Optional[int] = None  # fewer warm-up rounds than the workload's
    held: Optional[Callable[[], int]] = None  # bytes this variant holds besides the shared model (AttendOut's Attacker)


# builder(bench, workload) -> Step; ``workload`` names the bench's batch to run on.
Builder = Callable[[object, str], Step]


@dataclass(frozen=True)
class Variant:
    """A row of the table: what runs, on which workload of each framework, and its targets."""

    name: str
    description: str
    workload: str  # "train", "train-small", "validation" or "generation"
    builders: Dict[str, Builder]  # framework -> builder
    time_target: Optional[float] = None
    mem_target: Optional[float] = None
    repeats: Optional[int] = None  # measured repeats, when fewer than the workload's (very slow variants)
    warmup: Optional[int] = None  # warm-up rounds, when fewer than the workload's
    # the step's own peak over plain's: a two-pass method's floor is two passes' activations (2.0)
    step_mem_target: Optional[float] = None
    # opts -> why ``--variants all`` leaves this variant out on this machine (None: it runs)
    unavailable: Callable[[object], Optional[str]] = lambda opts: None


@dataclass(frozen=True)
class Derived:
    """A row computed from other rows: a run whose updates are split among variants equally."""

    name: str
    description: str
    parts: Sequence[str]
    time_target: Optional[float] = None
    mem_target: Optional[float] = None


# -- AD-DROP ----------------------------------------------------------------------------------
WORKLOAD_ORDER = ("validation", "generation", "train", "train-small")
INFERENCE_WORKLOADS = ("validation", "generation")
AD_DROP_P = AD_DROP_Q = 0.2  # the paper's EN-RO setting; cost barely depends on p and q


def idle_config():
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig

    return ADDropConfig(p=AD_DROP_P, q=AD_DROP_Q)


def ad_drop_builders(**options) -> Dict[str, Builder]:
    """Both frameworks' AD-DROP step, in an AD-DROP epoch (cross-tuning's even epoch)."""
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig

    def config(bench):
        return ADDropConfig(
            p=AD_DROP_P,
            q=AD_DROP_Q,
            attention="encoder-self",
            iga_steps=bench.opts.iga_steps,
            schedule="cross-tuning",
            **options,
        )

    def build(bench, workload):
        return bench.ad_drop_step(config(bench), epoch=2, batch=workload)

    return {"fairseq": build, "hf": build}


def idle_train_builders() -> Dict[str, Builder]:
    """Plugin loaded, AD-DROP criterion/trainer, but a plain epoch of cross-tuning (epoch 1)."""
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig

    def build(bench, workload):
        return bench.ad_drop_step(
            ADDropConfig(p=AD_DROP_P, q=AD_DROP_Q, schedule="cross-tuning"), epoch=1, batch=workload
        )

    return {"fairseq": build, "hf": build}


# -- AttendOut and the two no-extra-cost regularizers ------------------------------------------
def attendout_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig

    config = AttendOutConfig(dropout_step=20, attention="encoder-self", layers="all")
    return {"fairseq": lambda b, w: b.attendout_step(config, w), "hf": lambda b, w: b.attendout_step(config, w)}


def sched_dropout_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig

    config = ScheduledDropoutConfig(schedule="0:0.3,10000:0.1", attention="encoder-self")
    return {
        "fairseq": lambda b, w: b.scheduled_dropout_step(config, w),
        "hf": lambda b, w: b.attn_reg_step(w, scheduled_dropout=config),
    }


def layerdrop_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig

    config = AttentionLayerDropConfig(p=0.2, attention="encoder-self")
    return {
        "fairseq": lambda b, w: b.layerdrop_step(config, w),
        "hf": lambda b, w: b.attn_reg_step(w, layerdrop=config),
    }


# -- The papers' baselines --------------------------------------------------------------------
DROPHEAD_SCHEDULE = "0:0.1,5000:0,10000:0.1"  # the paper's V
DROPKEY_SCHEDULE = "dropkey:0.1"


def rdrop_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.rdrop import RDropConfig

    return {"fairseq": lambda b, w: b.rdrop_step(RDropConfig(), w), "hf": lambda b, w: b.rdrop_step(RDropConfig(), w)}


def hiddencut_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig

    return {
        "fairseq": lambda b, w: b.hiddencut_step(HiddenCutConfig(), w),
        "hf": lambda b, w: b.hiddencut_step(HiddenCutConfig(), w),
    }


def drophead_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig

    config = DropHeadConfig(schedule=DROPHEAD_SCHEDULE, attention="encoder-self")
    return {
        "fairseq": lambda b, w: b.drophead_step(config, w),
        "hf": lambda b, w: b.attn_reg_step(w, drophead=config),
    }


def dropkey_builders() -> Dict[str, Builder]:
    from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig

    config = ScheduledDropoutConfig(schedule=DROPKEY_SCHEDULE, attention="encoder-self")
    return {
        "fairseq": lambda b, w: b.scheduled_dropout_step(config, w),
        "hf": lambda b, w: b.attn_reg_step(w, scheduled_dropout=config),
    }


def no_native_bf16(opts) -> Optional[str]:
    """bf16 attribution on a CPU that emulates bf16 takes 15-30 plain steps: only when named."""
    from attn_reg_plugin.core.regularizers.attribution_pass import cpu_has_native_bf16

    if opts.device == "cpu" and not cpu_has_native_bf16():
        return "this CPU has no AVX-512, so bf16 matmuls are emulated (name it in --variants to measure it anyway)"
    return None


VARIANTS: List[Variant] = [
    Variant(
        "plugin-idle-train",
        "plugin loaded, plain epoch of cross-tuning (AD-DROP criterion idle)",
        "train",
        idle_train_builders(),
    ),
    Variant(
        "ad-drop-ga-all",
        "AD-DROP, gradient attribution, all layers (encoder self-attention)",
        "train",
        ad_drop_builders(attribution="ga", layers="all"),
        time_target=1.7,
        mem_target=1.15,
    ),
    Variant(
        "ad-drop-ga-all-bf16",
        "AD-DROP, gradient attribution, all layers, attribution pass under bf16 autocast "
        "(--ad-drop-attribution-precision bf16)",
        "train",
        ad_drop_builders(attribution="ga", layers="all", attribution_precision="bf16"),
        time_target=1.4,
        mem_target=1.15,
        unavailable=no_native_bf16,
    ),
    Variant(
        "ad-drop-ga-first",
        "AD-DROP, gradient attribution, first layer only",
        "train",
        ad_drop_builders(attribution="ga", layers="0"),
        time_target=1.6,
        mem_target=1.1,
    ),
    Variant(
        "ad-drop-aa-all",
        "AD-DROP, attention-weight attribution, all layers",
        "train",
        ad_drop_builders(attribution="aa", layers="all"),
    ),
    Variant(
        "ad-drop-rd-all",
        "AD-DROP, random candidate region, all layers",
        "train",
        ad_drop_builders(attribution="rd", layers="all"),
    ),
    # (m - 1) * layers + 1 forward/backward passes: a small batch, one measured step, no warm-up.
    Variant(
        "ad-drop-iga-all",
        "AD-DROP, integrated gradients (m steps), all layers; small batch",
        "train-small",
        ad_drop_builders(attribution="iga", layers="all"),
        repeats=1,
        warmup=0,
    ),
    Variant(
        "validation-idle",
        "validation forward, plugin loaded and idle, vs stock attention",
        "validation",
        {"fairseq": lambda b, w: b.validation_step(plugin=True), "hf": lambda b, w: b.validation_step(plugin=True)},
        time_target=1.02,
        mem_target=1.01,
    ),
    Variant(
        "generation-idle",
        "fairseq-generate path (SequenceGenerator, beam 5), plugin idle, vs stock",
        "generation",
        {"fairseq": lambda b, w: b.generation_step(plugin=True)},
        time_target=1.02,
        mem_target=1.01,
    ),
    Variant(
        "attendout",
        "AttendOut: Defender + Attacker + Generator on encoder self-attention, T=20 "
        "(median step: the held-out evaluation every T updates is amortised outside it)",
        "train",
        attendout_builders(),
        time_target=2.2,
        mem_target=2.2,
    ),
    Variant(
        "sched-dropout",
        "scheduled Bernoulli attention dropout, all encoder layers (p from 0.3 to 0.1)",
        "train",
        sched_dropout_builders(),
        time_target=1.05,
        mem_target=1.05,
    ),
    Variant(
        "attn-layerdrop",
        "attention LayerDrop, p = 0.2, all encoder layers",
        "train",
        layerdrop_builders(),
        time_target=1.05,
        mem_target=1.05,
    ),
    Variant(
        "rdrop",
        "R-Drop: two passes of the batch, CE of both + alpha * symmetric KL (alpha 1)",
        "train",
        rdrop_builders(),
        time_target=2.1,
        step_mem_target=2.2,
    ),
    Variant(
        "hiddencut",
        "HiddenCut: a clean pass and a pass with a span of each encoder layer's feed-forward output cut, + JS",
        "train",
        hiddencut_builders(),
        time_target=2.2,
        step_mem_target=2.2,
    ),
    Variant(
        "drophead",
        f"DropHead: (sample, head) outputs dropped, the paper's V schedule {DROPHEAD_SCHEDULE}, encoder self-attention",
        "train",
        drophead_builders(),
        time_target=1.1,
        step_mem_target=1.1,
    ),
    Variant(
        "dropkey",
        f"DropKey: scores dropped before the softmax, {DROPKEY_SCHEDULE} (rate falling with depth), encoder self-attention",
        "train",
        dropkey_builders(),
        time_target=1.1,
        step_mem_target=1.1,
    ),
]

DERIVED: List[Derived] = [
    Derived(
        "cross-tuned-ga-all",
        "cross-tuned run: plain epoch (plugin idle) + AD-DROP GA all-layers epoch, vs two plain epochs",
        parts=("plugin-idle-train", "ad-drop-ga-all"),
        time_target=1.35,
    ),
]
