"""The AttendOut game: the Attacker's masks per batch, and every T updates the Generator's REINFORCE
update and the choice of the survivor (paper Sec. 4.2, Eq. 3-5).

Choices the paper leaves open (also in docs/design.md):
* reward of held-out sample t: Defender loss minus Attacker loss on it (positive when the
  Attacker wins), paired with the action of update t as Eq. 5 pairs r_t with a_t;
* log P(a_t): the mean log-probability over the valid units (real query, real and allowed
  key) of every selected layer and every sample of update t (Eq. 5's 1/(n l^2) average);
* survivor: the Attacker with probability equal to its win rate over the T held-out samples
  (ties count half), else the Defender;
* actions are not stored: each batch's Gumbel noise is keyed draws of a recorded seed, made per
  block of query rows by the kernel (:class:`~.policy.GeneratorRule`) and made again, block by
  block, for the log-probabilities at the update (G does not change within a dropout step), which
  keeps memory linear in length and the cache small enough to checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ...kernel.attention_call import AttentionSite, EditScores, Record, add_counts, zero_counts
from ...kernel.controller import RegularizationController
from ...kernel.rules import key_seed
from ...training.distributed import all_reduce_mean_
from .config import AttendOutConfig
from .generator import Generator
from .heldout import win_probability
from .policy import (
    GeneratorRule,
    PolicyLogits,
    action_log_prob,
    kernel_draws,
    mean_drop_probability,
    reinforce_loss,
)

logger = logging.getLogger(__name__)


def _site_seed(seed: int, site_index: int) -> torch.Tensor:
    """The key of the actions at the ``site_index``-th selected site of a batch drawn with ``seed``."""
    return torch.tensor(key_seed(seed, site_index), dtype=torch.int64)


@dataclass
class _CachedBatch:
    update: int  # index of the update within the dropout step
    streams: Dict[str, torch.Tensor]
    seed: int
    on_kernel: bool  # its actions are the fused kernels' draws (policy.kernel_draws), not PyTorch's keyed ones
    # The Generator's mean drop probability per site on this batch, made when first asked (fairseq
    # logs it per batch) or by the Generator's update, which makes every logit anyway.
    probs: Optional[torch.Tensor] = None


class AttendOut:
    """Masks for the Attacker, the cache of one dropout step, the REINFORCE update and re-sync rule.

    ``controller`` holds the *Attacker's* attention sites. ``generator`` must already be on
    the training device.
    """

    def __init__(self, config: AttendOutConfig, controller: RegularizationController, generator: Generator):
        self.config = config.validate()
        self.sites: List[AttentionSite] = config.select_sites(controller)
        self.controller = controller
        self.generator = generator
        self.optimizer = torch.optim.Adam(generator.parameters(), lr=config.lr)
        self.baseline = 0.0
        self.update_in_step = 0  # updates completed in the current dropout step
        self.cache: List[_CachedBatch] = []
        self.dropout_steps_done = 0
        self._applied = zero_counts()  # [dropped, valid] units the kernel applied this dropout step
        self._latest: Tuple[Optional[_CachedBatch], List[PolicyLogits]] = (None, [])  # the last batch's logits

    @contextlib.contextmanager
    def attacker_pass(self, streams: Dict[str, torch.Tensor]) -> Iterator[Record]:
        """One forward of the Attacker under this batch's masks (:meth:`attacker_hooks`); what the
        kernel applied is added to this dropout step's counts when the block ends."""
        with self.controller.hooks(self.attacker_hooks(streams)) as record:
            yield record
        self._applied = add_counts(self._applied, record.counts())

    def site_names(self) -> List[str]:
        return [f"{s.kind}.{s.layer}" for s in self.sites]

    # -- during the T updates ------------------------------------------------------------
    def attacker_hooks(self, streams: Dict[str, torch.Tensor]) -> Dict[AttentionSite, EditScores]:
        """This batch's masks, as drop rules the kernel evaluates per block; remember how to
        recompute their log-probability (the streams and the seed, not the masks)."""
        seed = int(torch.randint(0, 2**62, (1,)).item())  # global CPU generator: seeded per update
        streams = {k: v.detach() for k, v in streams.items()}
        with torch.no_grad():
            policies = self.generator.policies(streams, self.sites)
        on_kernel = kernel_draws(self.generator.drop_bias, self.generator.dim)
        self.cache.append(_CachedBatch(self.update_in_step, streams, seed, on_kernel))
        self._latest = (self.cache[-1], policies)  # the probabilities, if asked, are made from these
        # The rate's denominator is the Generator's units: padding query rows are never masked.
        return {
            site: EditScores(
                drop=GeneratorRule(policy, _site_seed(seed, i), on_kernel),
                counted=True,
                droppable=None
                if policy.every_unit
                else (policy.query_real[:, None, :, None], policy.key_real[:, None, None, :]),
            )
            for i, (site, policy) in enumerate(zip(self.sites, policies))
        }

    def _log_prob(self, batch: _CachedBatch) -> torch.Tensor:
        """log P(a) of one batch's actions, regenerated from its seed: per sample, the mean over its
        units in all selected layers (Eq. 5's 1/(n l^2) average); then over samples. Fills the
        batch's mean drop probabilities on the way."""
        if batch.on_kernel and not kernel_draws(
            self.generator.drop_bias, self.generator.dim
        ):  # a step resumed elsewhere
            raise ValueError(
                "AttendOut: this dropout step's actions were drawn by the fused Triton kernels (a GPU's default), "
                f"which do not run on {self.generator.drop_bias.device} here: resume on such a device (or with "
                "ATTN_REG_FUSED=1 where Triton runs)"
            )
        total, count, probs = 0.0, 0, []
        for i, policy in enumerate(self.generator.policies(batch.streams, self.sites)):
            sums, units, prob_sum = action_log_prob(policy, _site_seed(batch.seed, i), batch.on_kernel)
            total, count = total + sums, count + units
            probs.append(prob_sum / units.sum().clamp(min=1))
        if batch.probs is None:
            batch.probs = torch.stack(probs)
        return (total / count.clamp(min=1)).mean()

    def _probabilities(self, batch: _CachedBatch) -> torch.Tensor:
        if batch.probs is None:
            latest, policies = self._latest
            with torch.no_grad():
                if latest is not batch:
                    policies = self.generator.policies(batch.streams, self.sites)
                batch.probs = torch.stack([mean_drop_probability(policy) for policy in policies])
        return batch.probs

    @property
    def last_drop_probabilities(self) -> Optional[torch.Tensor]:
        """Per site, the Generator's mean drop probability on the latest batch (a tensor: no host
        sync); None before the first batch of a dropout step."""
        return self._probabilities(self.cache[-1]) if self.cache else None

    def end_update(self) -> bool:
        """Count one finished update; True when the dropout step is complete (evaluate now)."""
        self.update_in_step += 1
        return self.update_in_step >= self.config.dropout_step

    def discard_update(self) -> None:
        """Forget the batches of the update in progress, as if they had not been seen: the
        Defender's step was dropped and its batch will be trained again (fairseq's AMP retry)."""
        self.cache = [c for c in self.cache if c.update != self.update_in_step]

    # -- end of a dropout step -------------------------------------------------------------
    def mean_drop_probabilities(self) -> Dict[str, float]:
        """Generator's mean drop probability per selected layer over the current dropout step."""
        if not self.cache:
            return {}
        values = torch.stack([self._probabilities(c) for c in self.cache]).mean(dim=0).tolist()
        return dict(zip(self.site_names(), values))

    def finish_dropout_step(
        self, defender_losses: torch.Tensor, attacker_losses: torch.Tensor, generator: Optional[torch.Generator] = None
    ) -> Dict[str, object]:
        """Reward G (Eq. 5) from per-sample held-out losses, update the baseline, pick the survivor.
        A step with a held-out loss that is not finite updates neither G nor the baseline (a warning
        says so); the survivor is still picked, a non-finite loss losing its comparison.

        Returns ``{"keep_attacker": bool, "win_rate", "reward", "baseline", "drop_prob": {...}, "drop_rate"}``:
        ``drop_prob`` is the Generator's mean probability per layer, ``drop_rate`` the fraction of the
        Attacker's units the Generator could mask (real query, real and allowed key) that the kernel
        dropped over the step (0 if its masks reached no attention). The adapter then copies the survivor over the other network.
        """
        rewards = (defender_losses.float() - attacker_losses.float()).detach()
        learns = self._rewards_finite(defender_losses, attacker_losses)
        updates = sorted({c.update for c in self.cache})
        log_probs = None
        if updates:
            self.generator.train()
            # Per update, its batches' log P(a) (made before any change to G, as the probabilities are)
            log_probs = torch.stack([
                torch.stack([self._log_prob(c) for c in self.cache if c.update == u]).mean() for u in updates
            ])  # fmt: skip
        dropped, valid = (int(c) for c in self._applied)
        stats: Dict[str, object] = {
            "drop_prob": self.mean_drop_probabilities(),
            "drop_rate": dropped / valid if valid else 0.0,
        }
        if log_probs is not None and learns:
            # Eq. 5 pairs r_t with a_t; with fewer held-out samples than updates, rewards repeat.
            paired = rewards[torch.arange(len(updates)) % len(rewards)]
            loss = reinforce_loss(log_probs, paired, self.baseline)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in self.generator.parameters() if p.grad is not None]
            all_reduce_mean_(grads)
            self.optimizer.step()
        mean_reward = float(rewards.mean())  # logged as it was, finite or not
        if learns:
            self.baseline = self.config.baseline_decay * self.baseline + (1 - self.config.baseline_decay) * mean_reward
        win_rate = win_probability(defender_losses.float(), attacker_losses.float())
        # ``generator`` keeps this draw off the global stream (fairseq passes one reseeded per update,
        # so a resumed run draws the same); workers agree by taking rank 0's choice (duel.end_dropout_step).
        keep_attacker = bool(torch.rand((), generator=generator) < win_rate.cpu())
        stats.update(keep_attacker=keep_attacker, win_rate=float(win_rate), reward=mean_reward, baseline=self.baseline)
        self.cache.clear()
        self._latest = (None, [])
        self.update_in_step = 0
        self._applied = zero_counts()
        self.dropout_steps_done += 1
        return stats

    def _rewards_finite(self, defender_losses: torch.Tensor, attacker_losses: torch.Tensor) -> bool:
        """Whether every held-out loss is finite on every worker. One that is not gives no reward to
        learn from: a single such step made the Generator's weights and the baseline NaN for the rest
        of the run. Every worker skips the update together (G's gradients are averaged over them)."""
        finite = (torch.isfinite(defender_losses).all() & torch.isfinite(attacker_losses).all()).float().reshape(1)
        all_reduce_mean_([finite])
        if finite.item() == 1.0:
            return True
        logger.warning(
            "AttendOut dropout step %d: %d of %d held-out losses of the Defender and %d of the Attacker are not "
            "finite; the Generator and its reward baseline are not updated at this step",
            self.dropout_steps_done + 1, int((~torch.isfinite(defender_losses)).sum()), len(defender_losses),
            int((~torch.isfinite(attacker_losses)).sum()),
        )  # fmt: skip
        return False

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        return {
            "generator": self.generator.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "baseline": self.baseline,
            "update_in_step": self.update_in_step,
            "dropout_steps_done": self.dropout_steps_done,
            "cache": [
                {
                    "update": c.update,
                    "streams": {k: v.cpu() for k, v in c.streams.items()},
                    "seed": c.seed,
                    "on_kernel": c.on_kernel,
                }  # fmt: skip
                for c in self.cache
            ],
            "applied": [int(c) for c in self._applied],
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        device = next(self.generator.parameters()).device
        saved, mine = state["generator"]["positions.weight"].shape[0], self.generator.positions.num_embeddings
        if saved != mine:  # max_positions unset sizes the generator to the model; older runs had 1024
            option = self.generator.positions_option
            raise ValueError(
                f"the saved game's generator has {saved} positions, this run's {mine}: set {option} to {saved}"
            )
        self.generator.load_state_dict(state["generator"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.baseline = float(state["baseline"])
        self.update_in_step = int(state["update_in_step"])
        self.dropout_steps_done = int(state["dropout_steps_done"])
        self.cache = [
            _CachedBatch(
                int(c["update"]),
                {k: v.to(device) for k, v in c["streams"].items()},
                int(c["seed"]),
                bool(c.get("on_kernel", False)),  # a state saved before 2026-11-29 drew in PyTorch
            )  # fmt: skip
            for c in state["cache"]
        ]

        # The batches' drop probabilities are made again from them when asked (a state saved before
        # 2026-11-27 holds their sums too, "prob_sums": the same numbers).
        self._applied = [torch.tensor(int(c)) for c in state.get("applied", (0, 0))]
