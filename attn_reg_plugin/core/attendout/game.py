"""The AttendOut game: the Attacker's masks per batch, and every T updates the Generator's REINFORCE
update and the choice of the survivor (paper Sec. 4.2, Eq. 3-5).

Choices the paper leaves open (also in docs/design.md):
* reward of held-out sample t: Defender loss minus Attacker loss on it (positive when the
  Attacker wins), paired with the action of update t as Eq. 5 pairs r_t with a_t;
* log P(a_t): the mean log-probability over the valid units (real query, real and allowed
  key) of every selected layer and every sample of update t (Eq. 5's 1/(n l^2) average);
* survivor: the Attacker with probability equal to its win rate over the T held-out samples
  (ties count half), else the Defender;
* actions are not stored: each batch's Gumbel noise comes from a recorded seed, and the
  log-probabilities are recomputed at the update (G does not change within a dropout step),
  which keeps memory flat and the cache small enough to checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch

from ..attention_call import AttentionSite, EditScores, PassRecord, add_counts, zero_counts
from ..controller import RegularizationController
from ..distributed import all_reduce_mean_
from .config import AttendOutConfig
from .generator import Generator
from .heldout import win_probability
from .policy import drop_log_prob, gumbel_drops, reinforce_loss


@dataclass
class _CachedBatch:
    update: int  # index of the update within the dropout step
    streams: Dict[str, torch.Tensor]
    seed: int


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
        self._prob_sums: Optional[torch.Tensor] = None  # per site, over this dropout step
        self._prob_batches = 0
        self._update_probs: List[torch.Tensor] = []  # this update's batches' probabilities (for discard_update)
        self.last_drop_probabilities: Optional[torch.Tensor] = None
        self._applied = zero_counts()  # [dropped, valid] units the kernel applied this dropout step

    @contextlib.contextmanager
    def attacker_pass(self, streams: Dict[str, torch.Tensor]) -> Iterator[PassRecord]:
        """One forward of the Attacker under this batch's masks (:meth:`attacker_hooks`); what the
        kernel applied is added to this dropout step's counts when the block ends."""
        with self.controller.hooks(self.attacker_hooks(streams)) as record:
            yield record
        self._applied = add_counts(self._applied, record.counts())

    def site_names(self) -> List[str]:
        return [f"{s.kind}.{s.layer}" for s in self.sites]

    # -- during the T updates ------------------------------------------------------------
    def attacker_hooks(self, streams: Dict[str, torch.Tensor]) -> Dict[AttentionSite, EditScores]:
        """Sample this batch's masks; remember how to recompute their log-probability."""
        seed = int(torch.randint(0, 2**62, (1,)).item())  # global CPU generator: seeded per update
        streams = {k: v.detach() for k, v in streams.items()}
        self.cache.append(_CachedBatch(self.update_in_step, streams, seed))
        with torch.no_grad():
            drops, units, probs = self._sample(streams, seed)
        self._prob_sums = probs if self._prob_sums is None else self._prob_sums + probs
        self._prob_batches += 1
        self._update_probs.append(probs)
        self.last_drop_probabilities = probs  # per site, this batch (a tensor: no host sync)
        # The rate's denominator is the Generator's units: padding query rows are never masked.
        return {site: EditScores(drop=d, counted=True, droppable=u) for site, d, u in zip(self.sites, drops, units)}

    def _sample(self, streams, seed, log_prob: bool = False):
        outputs = self.generator.drop_logits(streams, self.sites)
        device = outputs[0][0].device
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
        drops, units, probs, total, count = [], [], [], 0.0, 0
        for logits, valid in outputs:
            d = gumbel_drops(logits, rng) & valid
            drops.append(d)
            units.append(valid)
            p = torch.sigmoid(logits)
            probs.append((p * valid).sum() / valid.sum().clamp(min=1))
            if log_prob:
                total = total + (drop_log_prob(logits, d) * valid).sum(dim=(1, 2, 3))
                count = count + valid.sum(dim=(1, 2, 3))
        if log_prob:
            # Per sample: mean over its valid units in all selected layers; then over samples.
            return (total / count.clamp(min=1)).mean()
        return drops, units, torch.stack(probs).detach()

    def end_update(self) -> bool:
        """Count one finished update; True when the dropout step is complete (evaluate now)."""
        self.update_in_step += 1
        self._update_probs = []
        return self.update_in_step >= self.config.dropout_step

    def discard_update(self) -> None:
        """Forget the batches of the update in progress, as if they had not been seen: the
        Defender's step was dropped and its batch will be trained again (fairseq's AMP retry)."""
        self.cache = [c for c in self.cache if c.update != self.update_in_step]
        if self._update_probs:
            self._prob_sums = self._prob_sums - torch.stack(self._update_probs).sum(dim=0)
            self._prob_batches -= len(self._update_probs)
            if self._prob_batches == 0:
                self._prob_sums = None
        self._update_probs = []

    # -- end of a dropout step -------------------------------------------------------------
    def mean_drop_probabilities(self) -> Dict[str, float]:
        """Generator's mean drop probability per selected layer over the current dropout step."""
        if self._prob_sums is None:
            return {}
        values = (self._prob_sums / self._prob_batches).tolist()
        return dict(zip(self.site_names(), values))

    def finish_dropout_step(
        self, defender_losses: torch.Tensor, attacker_losses: torch.Tensor, generator: Optional[torch.Generator] = None
    ) -> Dict[str, object]:
        """Reward G (Eq. 5) from per-sample held-out losses, update the baseline, pick the survivor.

        Returns ``{"keep_attacker": bool, "win_rate", "reward", "baseline", "drop_prob": {...}, "drop_rate"}``:
        ``drop_prob`` is the Generator's mean probability per layer, ``drop_rate`` the fraction of the
        Attacker's units the Generator could mask (real query, real and allowed key) that the kernel
        dropped over the step (0 if its masks reached no attention). The adapter then copies the survivor over the other network.
        """
        rewards = (defender_losses.float() - attacker_losses.float()).detach()
        updates = sorted({c.update for c in self.cache})
        dropped, valid = (int(c) for c in self._applied)
        stats: Dict[str, object] = {
            "drop_prob": self.mean_drop_probabilities(),
            "drop_rate": dropped / valid if valid else 0.0,
        }
        if updates:
            self.generator.train()
            log_probs = []
            for u in updates:
                entries = [c for c in self.cache if c.update == u]
                log_probs.append(torch.stack([self._sample(c.streams, c.seed, log_prob=True) for c in entries]).mean())
            log_probs = torch.stack(log_probs)
            # Eq. 5 pairs r_t with a_t; with fewer held-out samples than updates, rewards repeat.
            paired = rewards[torch.arange(len(updates)) % len(rewards)]
            loss = reinforce_loss(log_probs, paired, self.baseline)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in self.generator.parameters() if p.grad is not None]
            all_reduce_mean_(grads)
            self.optimizer.step()
        mean_reward = float(rewards.mean())
        self.baseline = self.config.baseline_decay * self.baseline + (1 - self.config.baseline_decay) * mean_reward
        win_rate = win_probability(defender_losses.float(), attacker_losses.float())
        # ``generator`` keeps this draw off the global stream (fairseq passes one reseeded per update,
        # so a resumed run draws the same); workers agree by taking rank 0's choice (duel.end_dropout_step).
        keep_attacker = bool(torch.rand((), generator=generator) < win_rate.cpu())
        stats.update(keep_attacker=keep_attacker, win_rate=float(win_rate), reward=mean_reward, baseline=self.baseline)
        self.cache.clear()
        self.update_in_step = 0
        self._prob_sums, self._prob_batches, self._update_probs = None, 0, []
        self._applied = zero_counts()
        self.dropout_steps_done += 1
        return stats

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        return {
            "generator": self.generator.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "baseline": self.baseline,
            "update_in_step": self.update_in_step,
            "dropout_steps_done": self.dropout_steps_done,
            "cache": [
                {"update": c.update, "streams": {k: v.cpu() for k, v in c.streams.items()}, "seed": c.seed}
                for c in self.cache
            ],
            "prob_sums": None if self._prob_sums is None else self._prob_sums.cpu(),
            "prob_batches": self._prob_batches,
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
            _CachedBatch(int(c["update"]), {k: v.to(device) for k, v in c["streams"].items()}, int(c["seed"]))
            for c in state["cache"]
        ]
        sums = state["prob_sums"]
        self._prob_sums = None if sums is None else sums.to(device)
        self._prob_batches = int(state["prob_batches"])
        self._applied = [torch.tensor(int(c)) for c in state.get("applied", (0, 0))]
