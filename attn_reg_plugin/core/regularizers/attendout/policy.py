"""The Generator's policy, block by block: its drop logits, the Gumbel-max sampling of its actions
as a drop rule of the kernel, their log-probability for REINFORCE (Eq. 5), and the REINFORCE loss.

Layer l's drop logit of (query i, key j) is the Generator's single-head score of its layer-l states,
``(query(h_i) . key(h_j) / sqrt(d) + bias) / temperature``. A :class:`PolicyLogits` holds its factors,
(B, T, d) and (B, S, d), so any block of query rows makes its own logits: no (T, S) map of logits,
actions or log-probabilities is ever held whole. The actions are keyed draws of the batch's seed
(:func:`~attn_reg_plugin.core.kernel.rules.keyed_draws`), the same one block or many, so the
log-probability at the Generator's update regenerates them instead of storing them.

Where the fused route serves (by default a GPU: :func:`kernel_draws`), the actions are the fused
kernel's own draws instead (Philox, ``rules.SampledLogits``): its attention calls drop them inside the
kernel, a call it does not take drops the same units on the PyTorch path, and the log-probability is
the Triton kernels' (:mod:`~attn_reg_plugin.core.kernel.fused_policy`). A batch's actions come from one
source, recorded with it (``kernel_draws``): the one its log-probability regenerates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ...kernel import devices
from ...kernel.rules import CHUNK_ROWS, Block, BlockRule, LogitFactors, SampledLogits, keyed_draws

# The keyed stream of a unit's uniform, which decides its action.
ACTION_STREAM = 0
# Query rows per block of the log-probability and the probability statistics: about this many
# logits (times the temporaries of one) at a time.
POLICY_BLOCK_ELEMENTS = 1 << 19


def gumbel_drops(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over {keep: 0, drop: logit}, True (drop) with probability sigmoid(logit). The
    difference of the two Gumbel variables is logistic, logit(u) for a uniform u, so one uniform per
    unit decides: drop where logit - logit(u) > 0, i.e. where u < sigmoid(logit) (``uniforms`` in
    [0, 1), the shape of ``logits``; a logit of -inf never drops)."""
    return uniforms < torch.sigmoid(logits.float())


def drop_log_prob(logits: torch.Tensor, drops: torch.Tensor) -> torch.Tensor:
    """log P(action) per unit: log sigmoid(l) where dropped, log sigmoid(-l) where kept."""
    logits = logits.float()
    return torch.where(drops, F.logsigmoid(logits), F.logsigmoid(-logits))


def reinforce_loss(log_probs: torch.Tensor, rewards: torch.Tensor, baseline: float) -> torch.Tensor:
    """Minus Eq. 5's objective: its gradient is -(1/T) sum_t (r_t - b) grad log P(a_t)."""
    advantage = (rewards.float() - baseline).to(log_probs.device)
    return -(advantage * log_probs).mean()


@dataclass(frozen=True, eq=False)
class PolicyLogits(LogitFactors):
    """One layer's drop logits as factors (:class:`~attn_reg_plugin.core.kernel.rules.LogitFactors`), with
    ``query`` = query(h) / (sqrt(d) temperature), ``key`` = key(h), ``offset`` = bias / temperature."""

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """(B, 1, T, S): one mask per sample, shared by the layer's heads."""
        return (self.query.shape[0], 1, self.query.shape[1], self.key.shape[1])

    def block(self, rows: slice, keys: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logits, units) of query ``rows`` over keys ``0 .. keys - 1``, each (B, 1, rows, keys);
        units None where every pair is one. In float32 under any autocast (a one-block call runs under
        the model's): the actions must be those REINFORCE's float32 log-probability makes again."""
        with torch.autocast(self.query.device.type, enabled=False):
            logits = torch.matmul(self.query[:, rows], self.key[:, :keys].transpose(-2, -1)).add_(self.offset)
        if self.every_unit:
            return logits.unsqueeze(1), None
        units = self.query_real[:, rows, None] & self.key_real[:, None, :keys]
        if self.causal:
            t, s = self.query.shape[1], self.key.shape[1]
            position = torch.arange(rows.start, rows.stop, device=units.device)[:, None] + (s - t)
            units = units & (torch.arange(keys, device=units.device)[None, :] <= position)
        return logits.unsqueeze(1), units.unsqueeze(1)

    def row_blocks(self):
        """The query rows of each block of a pass over the whole map, in order (whole chunks of draws)."""
        b, _, t, s = self.shape
        rows = max(CHUNK_ROWS, POLICY_BLOCK_ELEMENTS // max(1, b * s) // CHUNK_ROWS * CHUNK_ROWS)
        return [slice(start, min(t, start + rows)) for start in range(0, t, rows)]

    def detached(self) -> PolicyLogits:
        return self.with_factors(self.query.detach(), self.key.detach(), self.offset.detach())

    def sampled(self, seed: torch.Tensor) -> SampledLogits:
        """The policy as the fused kernels draw it, its actions keyed by ``seed`` (a 0-d int64 CPU tensor)."""
        # Each field by name, no dataclasses.fields and no int(seed): a compiled graph calls it whole.
        return SampledLogits(self.query, self.key, self.offset, self.query_real, self.key_real, self.causal,
                             self.every_unit, seed)  # fmt: skip


def kernel_draws(query: torch.Tensor, width: int) -> bool:
    """Whether a batch on ``query``'s device with a Generator of ``width`` features draws its actions with the
    fused kernels (where the fused route is asked and Triton runs there, the policy not wider than the
    kernels take, by default once the kernels' first-use check passed on it)."""
    if not devices.fused_route_asked(query):
        return False
    from ...kernel.fused_route import policy_on_kernel  # Triton is imported only when the route is asked

    return policy_on_kernel(query, width)


def _masked(x: torch.Tensor, units) -> torch.Tensor:
    return x if units is None else x.masked_fill(~units, 0.0)


def _count(units, logits: torch.Tensor) -> torch.Tensor:
    """Units per sample of a block, (B,)."""
    if units is None:
        return torch.full((logits.shape[0],), logits[0].numel(), dtype=torch.long, device=logits.device)
    return units.sum(dim=(1, 2, 3))


def sampled_drops(policy: PolicyLogits, seed: torch.Tensor, rows: slice, keys: int):
    """(drops, logits, units) of query ``rows`` over keys ``0 .. keys - 1``: the actions of the policy
    keyed by ``seed`` (a 0-d int64 CPU tensor), dropped only within its units."""
    logits, units = policy.block(rows, keys)
    uniforms = keyed_draws(seed, ACTION_STREAM, list(policy.shape), rows.start, rows.stop, keys, True, logits.device)
    drops = gumbel_drops(logits, uniforms)
    return (drops if units is None else drops & units), logits, units


@dataclass(frozen=True, eq=False)
class GeneratorRule(BlockRule):
    """The Attacker's drops at one site: the Generator's actions (:func:`sampled_drops`) for the
    block's rows, one mask per sample shared by the heads. The actions are keyed by the batch's own
    ``seed``, not the call's, so the Generator's update regenerates them."""

    policy: PolicyLogits
    seed: torch.Tensor
    on_kernel: bool = False  # the fused kernels' draws (:func:`kernel_draws`), else keyed draws in PyTorch
    draws = False  # its numbers come from its own seed: the pass takes no call seed for them

    def sampled_logits(self) -> Optional[SampledLogits]:
        return self.policy.sampled(self.seed) if self.on_kernel else None

    def drops(self, block: Block) -> torch.Tensor:
        if tuple(block.call_shape[2:]) != self.policy.shape[2:]:
            raise ValueError(
                f"AttendOut: the Generator's masks cover {self.policy.shape[2]} queries x {self.policy.shape[3]} "
                f"keys, but the attention call has {block.call_shape[2]} x {block.call_shape[3]}: the streams "
                "given to the game must be the tokens the attention reads"
            )
        return self._drops(block.rows, block.shape[-1]).to(block.valid.device)

    def dense(self) -> torch.Tensor:
        """The whole (B, 1, T, S) mask, in one block (tests, small maps)."""
        _, _, t, s = self.policy.shape
        return self._drops(slice(0, t), s)

    def _drops(self, rows: slice, keys: int) -> torch.Tensor:
        with torch.no_grad():
            if self.on_kernel:
                from ...kernel.fused_policy import policy_drops

                return policy_drops(self.policy.sampled(self.seed), rows, keys)
            return sampled_drops(self.policy, self.seed, rows, keys)[0]


def mean_drop_probability(policy: PolicyLogits) -> torch.Tensor:
    """The mean of sigmoid(logit) over the policy's units (0-d), block by block, without gradient."""
    total = torch.zeros((), dtype=torch.float32, device=policy.query.device)
    count = torch.zeros((), dtype=torch.long, device=policy.query.device)
    with torch.no_grad():
        for rows in policy.row_blocks():
            logits, units = policy.block(rows, policy.key.shape[1])
            total += _masked(torch.sigmoid_(logits), units).sum()
            count += _count(units, logits).sum()
    return total / count.clamp(min=1)


class _ActionLogProb(torch.autograd.Function):
    """Per sample, the sum over the policy's units of log P(action) (and, not differentiable, the
    units and the probabilities' sum), block by block. The backward
    makes each block's logits and actions again: d/dlogit of log P = action - sigmoid(logit)."""

    @staticmethod
    def forward(ctx, query, key, offset, policy: PolicyLogits, seed):
        policy = policy.with_factors(query, key, offset)
        sums = torch.zeros(query.shape[0], dtype=torch.float32, device=query.device)
        counts = torch.zeros(query.shape[0], dtype=torch.long, device=query.device)
        probability = torch.zeros((), dtype=torch.float32, device=query.device)
        for rows in policy.row_blocks():
            drops, logits, units = sampled_drops(policy, seed, rows, key.shape[1])
            sums += _masked(drop_log_prob(logits, drops), units).sum(dim=(1, 2, 3))
            counts += _count(units, logits)
            probability += _masked(torch.sigmoid(logits), units).sum()
        ctx.save_for_backward(query, key, offset, seed)
        ctx.policy = policy.detached()
        ctx.mark_non_differentiable(counts, probability)
        return sums, counts, probability

    @staticmethod
    def backward(ctx, grad_sums, _counts, _probability):
        query, key, offset, seed = ctx.saved_tensors
        policy = ctx.policy.with_factors(query, key, offset)
        grad_query, grad_key = torch.zeros_like(query), torch.zeros_like(key)
        grad_offset = torch.zeros((), dtype=torch.float32, device=query.device)
        for rows in policy.row_blocks():
            drops, logits, units = sampled_drops(policy, seed, rows, key.shape[1])
            grad_logits = _masked(drops.float() - torch.sigmoid(logits), units)
            grad_logits = (grad_logits * grad_sums.view(-1, 1, 1, 1)).squeeze(1)
            grad_query[:, rows] = torch.matmul(grad_logits, key)
            grad_key += torch.matmul(grad_logits.transpose(-2, -1), query[:, rows])
            grad_offset += grad_logits.sum()
        return grad_query, grad_key, grad_offset.to(offset.dtype), None, None


def action_log_prob(
    policy: PolicyLogits, seed: torch.Tensor, on_kernel: bool = False
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of log P(action) over each sample's units (B,), each sample's units (B,), the sum of the
    drop probabilities sigmoid(logit) over all units (0-d)) of the actions keyed by ``seed``, the fused
    kernels' draws with ``on_kernel`` (:class:`GeneratorRule`'s); the first differentiable in the
    policy's factors, with memory linear in length."""
    if on_kernel:
        from ...kernel.fused_policy import policy_log_prob

        return policy_log_prob(policy.sampled(seed))
    return _ActionLogProb.apply(policy.query, policy.key, policy.offset, policy, seed)
