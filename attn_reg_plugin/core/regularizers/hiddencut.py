"""HiddenCut (Chen et al., ACL 2021; SALT-NLP/HiddenCut): a clean pass and a cut pass of the same
batch, trained to agree; in the cut pass each selected layer zeroes one contiguous span of its
hidden states.

The span, per sequence and layer (:func:`hiddencut_spans`), as the official code draws it
(``BertOutput.forward``, ``aug_type attn_span_cutoff``):

* ``n`` = the sequence's real (non-padding) tokens; the span is ``max(1, floor(ratio * n))`` tokens
  long (ratio 0.1), its start drawn uniformly among the ``max(1, floor(top * n))`` real tokens that
  receive the most attention (top 0.4; ties: the lower position ranks first); a span that would run
  past the last real token stops there, and padding is never cut.
* "Attention received" is the layer's self-attention map averaged over heads and over its real
  queries (:func:`attention_received`). The official code sums over all queries and averages the
  heads: the same ranking, up to padded query rows. Here the map is the **clean** pass's (the
  official code reads the cut pass's own map, which earlier layers' cuts change): every mask is then
  fixed before the cut pass starts, so a checkpointed layer's recompute applies the same cut.

The objective, with the official script's weights (``--aug_ce_loss 1.0 --aug_js_loss 1.0``)::

    loss = CE(clean) + CE(cut) + alpha * JS,   JS(p, q) = (KL(p || m) + KL(q || m)) / 2,  m = (p + q) / 2

JS per position in nats (:func:`js_divergence`), summed over the positions the CE covers and divided
by what the CE is divided by (:func:`js_consistency`): per sample for a classifier (the official
``batchmean``), per real target token in fairseq, as ``core.rdrop`` reduces its KL. The gradient
flows through both passes (no stop-gradient), as in the official code. One deliberate difference:
the official ``js_div`` calls ``F.kl_div(p.log(), m)``, which is KL(m || p), not KL(p || m); this
module computes the Jensen-Shannon divergence the paper states. alpha defaults to 1.0.

Where the cut is applied is the adapter's choice (:class:`SpanCut` hooks any module's output): the
paper's point is the layer's feed-forward output (before the residual), which fairseq's encoder layer
exposes as ``fc2``; the Hugging Face trainers find it per family (``hf.feed_forward_cut``). The
official code cuts every layer (``layers='all'``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Mapping, Optional, Protocol, Tuple

import torch

from .combinations import HIDDENCUT
from .options import RegularizerOptions, option
from .registry import OWN_PASSES, Method, Regularizer, register
from .training_step import Logged, StepResult, TrainingStep


def _fraction(config, field: str) -> None:
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{config.name(field)} must be a fraction in (0, 1], got {value!r}")


@dataclass
class HiddenCutConfig(RegularizerOptions):
    """HiddenCut's options; the fairseq flags are these names prefixed with ``--hiddencut-``."""

    FLAG_PREFIX = "--hiddencut-"

    ratio: float = option(
        0.1,
        "length of the cut span as a fraction of the sequence's real tokens (floor, at least 1 token; the paper's 0.1)",
        "a fraction in (0, 1]",
    )
    top: float = option(
        0.4,
        "the span's start is drawn uniformly among this fraction of the real tokens that receive the most "
        "attention (floor, at least 1; the paper's 0.4)",
        "a fraction in (0, 1]",
    )
    alpha: float = option(
        1.0,
        "weight of the consistency term: loss = CE(clean) + CE(cut) + alpha * JS(clean || cut), JS summed over "
        "the CE's positions and divided as the CE is (the official script's 1.0; 0 = two passes, no JS)",
        "finite number >= 0",
    )
    layers: str = option(
        "all",
        "which layers cut a span (the official code cuts every layer); fairseq: encoder layers",
        "all, or a comma list of 0-based layer indices, each < the model's layer count",
    )

    def validate(self) -> HiddenCutConfig:
        """Check every option; the error names the option as the user spelled it (core.options.option_name)."""
        from ..kernel.controller import parse_layers

        _fraction(self, "ratio")
        _fraction(self, "top")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < math.inf:
            raise ValueError(f"{self.name('alpha')} must be a finite number >= 0, got {alpha!r}")
        parse_layers(self.layers, self.name("layers"))
        return self

    def selected_layers(self, count: int, what: str = "layers") -> list:
        """The 0-based indices ``layers`` selects among ``count`` layers (``what``: their name in the error,
        e.g. fairseq's "encoder layers"); an index past them is refused."""
        from ..kernel.controller import parse_layers

        wanted = parse_layers(self.layers, self.name("layers"))
        if wanted is None:
            return list(range(count))
        if wanted[-1] >= count:
            raise ValueError(f"{self.name('layers')}: the model has {count} {what} (0-{count - 1}), got {wanted[-1]}")
        return wanted


REGULARIZER = register(
    Regularizer(
        "hiddencut",
        HIDDENCUT,
        HiddenCutConfig,
        "",
        None,
        "hiddencut",
        passes=OWN_PASSES,
        step=lambda config, step, sites: hiddencut_step(config, step, sites),
        logged=(
            Logged("hiddencut_js", "hiddencut_js_sum", "hiddencut_positions"),
            Logged("hiddencut_cut", "hiddencut_cut"),
            Logged("hiddencut_tokens", "hiddencut_tokens"),
        ),
        methods=(
            Method(
                "hiddencut",
                "HiddenCut (clean + cut pass + alpha * JS), its defaults",
                fairseq_criterion="hiddencut_label_smoothed_cross_entropy",
                trainer="HiddenCutTrainer",
            ),
        ),
    )
)


def attention_received(weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per key token, the attention it receives: ``weights`` (B, H, T, T) softmax rows averaged over
    heads and over the real queries ``valid`` (B, T) marks -> (B, T) float32, 0 at padding."""
    valid = valid.to(torch.bool)
    rows = valid.to(torch.float32)[:, None, :, None]
    summed = (weights.to(torch.float32) * rows).sum(dim=2).mean(dim=1)  # (B, T): over queries, then heads
    return (summed / rows.sum(dim=2)[:, 0].clamp(min=1)).masked_fill(~valid, 0.0)


RECEIVED_BLOCK_ELEMENTS = 1 << 21  # float32 scores of one block of query rows (8 MiB)


def attention_received_by_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    scale: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """:func:`attention_received` of a self-attention's softmax(scale * q k^T + mask), made from its
    queries (B, H, T, d) and keys (B, H or a divisor of H, T, d) one block of query rows at a time, in
    float32 and without gradient: no (T, T) map is held, so the ranking is linear in the length.

    ``mask``: additive (float) or True-to-attend (bool), broadcastable to (B, H, T, T), or None;
    ``causal``: key j is masked for query i < j (as sdpa's ``is_causal``); ``softcap``: the scaled scores
    become softcap * tanh(scores / softcap) before the mask (Gemma-2's eager attention). Rows no key may
    reach add 0. Keys that ``valid`` (B, T) marks as padding are masked too, whatever ``mask`` says (the
    fairseq criterion gives padding only there), so the softmax is over real keys."""
    batch, heads, length, dim = query.shape
    scale = dim**-0.5 if scale is None else scale
    valid = valid.to(torch.bool)
    rows_real = valid.to(torch.float32)
    with torch.no_grad():
        keys = key.float().repeat_interleave(heads // key.shape[1], dim=1).transpose(-2, -1)  # GQA: heads share keys
        if mask is not None:  # as 4-d, its rows spelled out so that a block of them can be sliced
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            mask = mask.expand(*mask.shape[:2], length, length)
        summed = torch.zeros(batch, heads, length, dtype=torch.float32, device=query.device)
        rows = max(1, RECEIVED_BLOCK_ELEMENTS // max(1, batch * heads * length))
        for start in range(0, length, rows):
            block = slice(start, min(length, start + rows))
            scores = torch.matmul(query[:, :, block].float(), keys) * scale  # (B, H, rows, T)
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if mask is not None and mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask[:, :, block], -math.inf)
            elif mask is not None:
                scores = scores + mask[:, :, block].float()
            if causal:
                later = (
                    torch.arange(length, device=query.device)
                    > torch.arange(block.start, block.stop, device=query.device)[:, None]
                )
                scores = scores.masked_fill(later, -math.inf)
            weights = torch.softmax(scores.masked_fill(~valid[:, None, None, :], -math.inf), dim=-1).nan_to_num(0.0)
            summed += (weights * rows_real[:, None, block, None]).sum(dim=2)
    received = summed.mean(dim=1) / rows_real.sum(dim=1, keepdim=True).clamp(min=1)
    return received.masked_fill(~valid, 0.0)


def _floor_fraction(lengths: torch.Tensor, fraction: float) -> torch.Tensor:
    # floor(fraction * n) in float64 with a tolerance, so 0.1 * 30 is 3 and not 2.999...; at least 1
    return torch.floor(lengths.to(torch.float64) * fraction + 1e-9).long().clamp(min=1)


def hiddencut_spans(
    valid: torch.Tensor,
    received: torch.Tensor,
    ratio: float = 0.1,
    top: float = 0.4,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """The cut mask (B, T) bool: per row one contiguous span of real tokens (see the module docstring).

    ``valid``: (B, T), true at real tokens; ``received``: (B, T), the attention each token receives
    (:func:`attention_received`; its values at padding are ignored). ``generator``: the draws' random
    source (one uniform number per row, on ``generator``'s device; the global one when None). A row
    without real tokens gets no span.
    """
    valid = valid.to(torch.bool)
    batch, length = valid.shape
    if length == 0:  # no positions: no span (and no start to gather)
        return valid
    n = valid.sum(dim=1)
    scores = received.to(torch.float32).masked_fill(~valid, -math.inf)
    # stable descending sort: equal scores keep their order, so the lower position ranks first
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    device = generator.device if generator is not None else valid.device
    u = torch.rand(batch, generator=generator, device=device, dtype=torch.float64).to(valid.device)
    k = _floor_fraction(n, top)
    pick = torch.minimum((u * k).long(), k - 1)
    start = order.gather(1, pick[:, None])  # (B, 1): a real token when the row has one
    span = _floor_fraction(n, ratio)[:, None]
    positions = torch.arange(length, device=valid.device)[None, :]
    cut = (positions >= start) & (positions < start + span) & valid
    return cut & (n > 0)[:, None]


JS_BLOCK_ELEMENTS = 1 << 20  # (positions, classes) elements of one block of the JS and its gradient


def js_divergence(scores_1: torch.Tensor, scores_2: torch.Tensor, log_probs: bool = False) -> torch.Tensor:
    """(KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2, per position over the last dimension (nats).

    ``scores``: logits (softmax taken here, in float32 at least), or, with ``log_probs``, the
    log-probabilities a model already normalized. Between 0 and log 2."""
    dtype = torch.promote_types(scores_1.dtype, torch.float32)
    return _JensenShannon.apply(scores_1.to(dtype), scores_2.to(dtype), log_probs)


def _js_terms(lp: torch.Tensor, lq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """p (log p - log m) and q (log q - log m) per class, of two log-probability tensors."""
    # A class of probability 0 adds 0 (the limit of p log p / m), not 0 * -inf = NaN; where it is
    # impossible in both, m is taken of stand-in zeros, as logaddexp at (-inf, -inf) is NaN to differentiate.
    both_impossible = (lp == -math.inf) & (lq == -math.inf)
    lm = torch.logaddexp(lp.masked_fill(both_impossible, 0.0), lq.masked_fill(both_impossible, 0.0)) - math.log(2.0)

    def term(log_p):
        return log_p.exp() * torch.where(log_p == -math.inf, 0.0, log_p - lm)

    return term(lp), term(lq)


class _JensenShannon(torch.autograd.Function):
    """The JS divergence per position of two score tensors (..., classes), block by block of positions.

    It keeps only its inputs, not the dozen (positions, classes) intermediates autograd would, and makes
    its gradient again from them one block at a time: d JS / d log p = p (log p - log m) / 2 (the same
    in q), then through the log-softmax, g - p * sum(g), when the scores are logits. At a causal LM's
    4,096 tokens x its vocabulary those intermediates were most of what a HiddenCut step held beyond its
    two passes (PERFORMANCE.md, "The baselines' cost")."""

    @staticmethod
    def _blocks(scores_1: torch.Tensor, scores_2: torch.Tensor):
        """Both score tensors as (positions, classes), and the blocks of positions to take them in."""
        flat_1, flat_2 = (s.reshape(-1, scores_1.shape[-1]) for s in (scores_1, scores_2))
        rows = max(1, JS_BLOCK_ELEMENTS // max(1, flat_1.shape[1]))
        return flat_1, flat_2, [slice(i, min(flat_1.shape[0], i + rows)) for i in range(0, flat_1.shape[0], rows)]

    @staticmethod
    def _log_probs(flat, block, log_probs):
        return flat[block] if log_probs else torch.log_softmax(flat[block], dim=-1)

    @staticmethod
    def forward(ctx, scores_1: torch.Tensor, scores_2: torch.Tensor, log_probs: bool) -> torch.Tensor:
        ctx.save_for_backward(scores_1, scores_2)
        ctx.log_probs = log_probs
        flat_1, flat_2, blocks = _JensenShannon._blocks(scores_1, scores_2)
        out = flat_1.new_empty(flat_1.shape[0])
        for block in blocks:
            lp, lq = (_JensenShannon._log_probs(f, block, log_probs) for f in (flat_1, flat_2))
            term_p, term_q = _js_terms(lp, lq)
            out[block] = 0.5 * (term_p.sum(-1) + term_q.sum(-1))
        return out.view(scores_1.shape[:-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scores_1, scores_2 = ctx.saved_tensors
        flat_1, flat_2, blocks = _JensenShannon._blocks(scores_1, scores_2)
        grads = torch.empty_like(flat_1), torch.empty_like(flat_2)
        half = 0.5 * grad.reshape(-1, 1)
        for block in blocks:
            lps = [_JensenShannon._log_probs(f, block, ctx.log_probs) for f in (flat_1, flat_2)]
            for log_p, term, out in zip(lps, _js_terms(*lps), grads):
                g = half[block] * term
                out[block] = g if ctx.log_probs else g - log_p.exp() * g.sum(-1, keepdim=True)
        return grads[0].view(scores_1.shape), grads[1].view(scores_2.shape), None


def js_consistency(
    scores_1: torch.Tensor, scores_2: torch.Tensor, keep: Optional[torch.Tensor] = None, log_probs: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The JS divergence summed over the positions ``keep`` marks (all when None), and their number;
    both tensors (no host sync). The caller divides the sum as it divides its CE."""
    js = js_divergence(scores_1, scores_2, log_probs)
    if keep is None:
        return js.sum(), torch.tensor(js.numel(), device=js.device)
    return js.masked_fill(~keep, 0.0).sum(), keep.sum()


def hiddencut_objective(ce_clean: torch.Tensor, ce_cut: torch.Tensor, js: torch.Tensor, alpha: float) -> torch.Tensor:
    """HiddenCut's loss: both passes' CE added plus alpha times the JS term, all three reduced alike."""
    return ce_clean + ce_cut + alpha * js


def _zero_span(hidden: torch.Tensor, cut: torch.Tensor, time_first: bool) -> torch.Tensor:
    keep = ~cut.t() if time_first else ~cut  # (T, B) or (B, T)
    if hidden.shape[:2] != keep.shape:
        raise ValueError(
            f"HiddenCut: a cut mask of shape {tuple(cut.shape)} does not fit an output {tuple(hidden.shape)}"
        )
    return hidden * keep.unsqueeze(-1).to(hidden.dtype)


class CutPlan:
    """One cut pass: ``masks`` {layer key: (cut (B, T) bool, valid (B, T) bool)}; counts what its hooks cut.

    ``cut`` and ``tokens`` (tensors once a hook ran) are the tokens cut and the real tokens of the
    layers that applied a mask; a layer that runs again in the same pass (a checkpointed layer's
    recompute) cuts the same tokens and is counted once (log keys ``hiddencut_cut`` / ``hiddencut_tokens``).
    """

    def __init__(self, masks: Dict[Any, Tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.masks = dict(masks)
        self.applied: set = set()
        self.cut: Any = 0
        self.tokens: Any = 0

    def cuts(self, key: Any) -> bool:
        """Whether this pass cuts layer ``key`` (a hook left by another Hugging Face trainer on the same model
        gets no mask): a layer it does not cut keeps its dropout."""
        return key in self.masks

    def apply(self, key: Any, output: Any, time_first: bool = False, positions: Optional[slice] = None) -> Any:
        """``output`` (a tensor, or a tuple whose first element is one; (B, T, D), or (T, B, D) with
        ``time_first``) with layer ``key``'s cut tokens zeroed (a new tensor: a cut token's gradient is 0);
        ``positions``: the positions of the sequence ``output`` holds, when a chunk of it."""
        if not self.cuts(key):
            return output
        cut, valid = self.masks[key]
        if key not in self.applied:  # counted where it happens, once per pass
            self.applied.add(key)
            self.cut = self.cut + cut.sum().detach()
            self.tokens = self.tokens + valid.sum().detach()
        if positions is not None:
            cut = cut[:, positions]
        if isinstance(output, tuple):
            return (_zero_span(output[0], cut, time_first), *output[1:])
        return _zero_span(output, cut, time_first)


class SpanCut:
    """Cut chosen modules' outputs through ``register_forward_hook``.

    ``attach(module, key)`` hooks ``module`` as layer ``key``. The pass's :class:`CutPlan` reaches the
    hook either as a keyword of the module's call (``kwarg``: Hugging Face layers get the model's
    keywords, and a checkpointed layer's recompute gets the same ones, so it repeats its forward's
    cut), or, for a module called without keywords (fairseq's ``fc2``), from :meth:`cutting`, which
    holds the plan only while the cut pass runs (so such a module must not be recomputed later: no
    activation checkpointing there). Without a plan the output passes unchanged.
    """

    def __init__(self) -> None:
        self.plan: Optional[CutPlan] = None
        self.handles: list = []

    def attach(self, module: torch.nn.Module, key: Any, time_first: bool = False, kwarg: Optional[str] = None) -> None:
        if kwarg is not None:

            def from_call(mod, args, kwargs, output):
                plan = kwargs.get(kwarg)
                return None if plan is None else plan.apply(key, output, time_first)

            self.handles.append(module.register_forward_hook(from_call, with_kwargs=True))
        else:

            def held(mod, args, output):
                return None if self.plan is None else self.plan.apply(key, output, time_first)

            self.handles.append(module.register_forward_hook(held))

    def cutting(self, plan: CutPlan) -> _Cutting:
        """A context in which the modules attached without ``kwarg`` cut as ``plan`` says."""
        return _Cutting(self, plan)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _Cutting:
    def __init__(self, owner: SpanCut, plan: CutPlan) -> None:
        self.owner, self.plan = owner, plan

    def __enter__(self) -> CutPlan:
        self.owner.plan = self.plan
        return self.plan

    def __exit__(self, *exc) -> None:
        self.owner.plan = None


class Ranking(Protocol):
    """The clean pass's ranking, as a framework records it: ``extra``, the keywords of the model's call
    that carry it (none where hooks record it), and ``ranked()``, {layer: (attention received (B, T),
    real tokens (B, T))} of every selected layer, in the layers' order (the spans are drawn in it)."""

    extra: Mapping[str, Any]

    def ranked(self) -> Dict[Any, Tuple[torch.Tensor, torch.Tensor]]: ...


class CutSites(Protocol):
    """Where a framework's model is ranked and cut: ``ranking()``, a context around the clean pass
    yielding its :class:`Ranking`; ``cutting(plan)``, a context around the cut pass yielding the
    keywords of the model's call that carry ``plan`` (it checks, on leaving, that every layer was cut)."""

    def ranking(self) -> ContextManager[Ranking]: ...

    def cutting(self, plan: CutPlan) -> ContextManager[Mapping[str, Any]]: ...


def hiddencut_step(config: HiddenCutConfig, step: TrainingStep, sites: CutSites) -> StepResult:
    """HiddenCut's training step over a framework's :class:`~.training_step.TrainingStep`: the clean pass,
    ranked; the spans drawn from its ranking; the cut pass; their JS at the positions the loss covers,
    reduced as the loss is, and the objective. Logs the JS's sum and positions, the tokens cut and the
    real tokens of the cut layers."""
    with sites.ranking() as ranking:
        clean = step.forward(ranking.extra)
        received = ranking.ranked()
    plan = CutPlan(
        {
            index: (hiddencut_spans(valid, rank, config.ratio, config.top), valid)
            for index, (rank, valid) in received.items()
        }
    )
    with sites.cutting(plan) as extra:
        cut = step.forward(extra)
    compared = step.compared(clean, cut, "HiddenCut's JS")
    js_sum, positions = js_consistency(compared.first, compared.second, compared.keep, log_probs=step.log_probs)
    pair_loss = clean.loss + cut.loss
    js = step.reduced(js_sum, positions, pair_loss, compared)
    loss = hiddencut_objective(clean.loss, cut.loss, js, config.alpha)
    sums = {"hiddencut_js_sum": js_sum.detach(), "hiddencut_positions": positions}
    return StepResult(loss, clean, cut, {**sums, "hiddencut_cut": plan.cut, "hiddencut_tokens": plan.tokens})
