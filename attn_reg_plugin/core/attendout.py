"""AttendOut (Wu, Zhao, Zhang): a learned score-dropout maker trained by a Defender/Attacker game.

Framework-free pieces; adapters (fairseq task, HF Trainer) own the two networks and their
optimizers and call into this module:

* :class:`Generator` (G-Net, paper Sec. 4.1): its own token and position embeddings, ONE
  single-head attention whose parameters are shared by all layers, no feed-forward. The
  layer-i attention scores, plus a shared bias and divided by the temperature, are the drop
  logits of the Attacker's layer i; actions are sampled with the Gumbel-max trick, so a unit
  is dropped with probability sigmoid(logit / temperature).
* :class:`AttendOut`: per training batch, the Attacker's masks (paper Eq. 3; a row whose every
  real key is dropped attends uniformly, Eq. 4, done in the kernel); every T updates the
  REINFORCE update of Eq. 5 with a moving-average baseline from per-sample rewards on T
  held-out samples, and the probabilistic choice of the survivor that re-syncs both networks.

Choices the paper leaves open (also in the README):
* reward of held-out sample t: Defender loss minus Attacker loss on it (positive when the
  Attacker wins), paired with the action of update t as Eq. 5 pairs r_t with a_t;
* log P(a_t): the mean log-probability over the valid units (real query, real and allowed
  key) of every selected layer and every sample of update t (Eq. 5's 1/(n l^2) average);
* survivor: the Attacker with probability equal to its win rate over the T held-out samples
  (ties count half), else the Defender; the survivor's parameters and optimizer state
  overwrite the other's;
* actions are not stored: each batch's Gumbel noise comes from a recorded seed, and the
  log-probabilities are recomputed at the update (G does not change within a dropout step),
  which keeps memory flat and the cache small enough to checkpoint.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import EditScores
from .controller import AttentionSite, RegularizationController, parse_kinds, parse_layers
from .distributed import all_reduce_mean_
from .options import config_from_namespace, flag_name, option


def _flag(name: str) -> str:
    return flag_name("--attendout-", name)


# Which token stream the generator reads for each attention kind: (query stream, key stream).
STREAMS_OF_KIND = {
    "encoder-self": ("source", "source"),
    "decoder-self": ("target", "target"),
    "encoder-decoder": ("target", "source"),
}


@dataclass
class AttendOutConfig:
    """AttendOut's options; the fairseq flags are these names prefixed with ``--attendout-``."""

    dropout_step: int = option(20, "T: updates per dropout step and held-out samples per evaluation, >= 1")
    generator_dim: int = option(64, "generator width (embeddings and its single attention head), >= 1")
    lr: float = option(1e-3, "generator Adam learning rate, > 0")
    temperature: float = option(1.0, "Gumbel temperature: drop probability = sigmoid(logit / temperature), > 0")
    baseline_decay: float = option(0.9, "moving-average baseline decay, in [0, 1)")
    init_drop: float = option(0.2, "drop probability the generator starts from, in (0, 1)")
    attention: str = option("encoder-self", "comma list of encoder-self, decoder-self, encoder-decoder")
    layers: str = option("all", "'all' or a comma list of 0-based layer indices")
    max_positions: int = option(1024, "longest sequence the generator covers, >= 1")

    def validate(self, flag: Callable[[str], str] = _flag) -> "AttendOutConfig":
        def integer(name, low):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag(name)} must be an integer >= {low}, got {value!r}")

        def number(name, check, accepted):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not check(value):
                raise ValueError(f"{flag(name)} must be {accepted}, got {value!r}")

        integer("dropout_step", 1)
        integer("generator_dim", 1)
        integer("max_positions", 1)
        number("lr", lambda v: 0 < v < math.inf, "a finite number > 0")
        number("temperature", lambda v: 0 < v < math.inf, "a finite number > 0")
        number("baseline_decay", lambda v: 0 <= v < 1, "in [0, 1)")
        number("init_drop", lambda v: 0 < v < 1, "in the open interval (0, 1)")
        parse_kinds(self.attention, flag("attention"))
        parse_layers(self.layers, flag("layers"))
        return self

    @classmethod
    def from_namespace(cls, ns, prefix: str = "attendout_") -> "AttendOutConfig":
        return config_from_namespace(cls, ns, prefix)


# -- the generator -------------------------------------------------------------------------
class Generator(nn.Module):
    """G-Net: per-layer drop logits from one shared single-head attention over its own embeddings.

    ``vocab_sizes`` / ``padding_idx`` per stream (``"source"``, ``"target"``); streams share
    one embedding table when they share a vocabulary (pass the same size and set
    ``share_streams``). Layer i's hidden state is ``LayerNorm(h + Attention(h))`` of layer i-1.
    """

    def __init__(self, vocab_sizes: Dict[str, int], padding_idx: Dict[str, int], dim: int, max_positions: int,
                 init_drop: float, temperature: float, share_streams: bool = False):
        super().__init__()
        self.dim, self.temperature, self.padding_idx = dim, float(temperature), dict(padding_idx)
        streams = list(vocab_sizes)
        if share_streams:
            table = nn.Embedding(vocab_sizes[streams[0]], dim, padding_idx=padding_idx[streams[0]])
            self.embeddings = nn.ModuleDict({s: table for s in streams})
        else:
            self.embeddings = nn.ModuleDict(
                {s: nn.Embedding(vocab_sizes[s], dim, padding_idx=padding_idx[s]) for s in streams}
            )
        for table in self.embeddings.values():
            nn.init.normal_(table.weight, std=dim ** -0.5)
            nn.init.zeros_(table.weight[table.padding_idx])
        self.positions = nn.Embedding(max_positions, dim)
        nn.init.normal_(self.positions.weight, std=dim ** -0.5)
        # The one attention head, shared by every layer (paper: "share one group of parameters").
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm = nn.LayerNorm(dim)
        # Shared offset of every drop logit: sets where the drop probability starts.
        self.drop_bias = nn.Parameter(torch.tensor(math.log(init_drop / (1 - init_drop)) * self.temperature))

    def _scores(self, hq: torch.Tensor, hk: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.query(hq), self.key(hk).transpose(-2, -1)) * self.dim ** -0.5

    def hidden_states(self, stream: str, tokens: torch.Tensor, num_layers: int, causal: bool) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Inputs of layers 0..num_layers-1 for one stream, and its (B, 1, L, L) validity."""
        length = tokens.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(
                f"{_flag('max_positions')}: a sequence of {length} tokens is longer than the generator's "
                f"{self.positions.num_embeddings} positions"
            )
        real = tokens.ne(self.padding_idx[stream])
        valid = real[:, None, None, :] & real[:, None, :, None]
        if causal:
            valid = valid & torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        # Positions count the sentence's own tokens (as fairseq's make_positions does): a
        # left-padded sentence (fairseq sources) gets the masks it gets unpadded, whatever batch it is in.
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        h = self.embeddings[stream](tokens) * self.dim ** 0.5 + self.positions(positions)
        states = [h]
        fill = torch.finfo(h.dtype).min / 4
        for _ in range(num_layers - 1):
            scores = self._scores(h, h).unsqueeze(1).masked_fill(~valid, fill)
            attn = torch.softmax(scores, dim=-1).squeeze(1)
            h = self.norm(h + self.out(torch.matmul(attn, self.value(h))))
            states.append(h)
        return states, valid

    def drop_logits(self, streams: Dict[str, torch.Tensor], sites: Sequence[AttentionSite]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(logits (B, 1, T, S), valid units (B, 1, T, S)) for each site, in order."""
        needed: Dict[str, int] = {}
        for site in sites:
            for stream in STREAMS_OF_KIND[site.kind]:
                needed[stream] = max(needed.get(stream, 0), site.layer + 1)
        missing = [s for s in needed if s not in streams]
        if missing:
            raise ValueError(f"AttendOut: the generator needs the {missing[0]} tokens for the selected attention kinds")
        states = {s: self.hidden_states(s, streams[s], n, causal=(s == "target")) for s, n in needed.items()}
        out = []
        for site in sites:
            q_stream, k_stream = STREAMS_OF_KIND[site.kind]
            hq, hk = states[q_stream][0][site.layer], states[k_stream][0][site.layer]
            if q_stream == k_stream:
                valid = states[q_stream][1]
            else:
                q_real = streams[q_stream].ne(self.padding_idx[q_stream])
                k_real = streams[k_stream].ne(self.padding_idx[k_stream])
                valid = q_real[:, None, :, None] & k_real[:, None, None, :]
            logits = (self._scores(hq, hk).unsqueeze(1) + self.drop_bias) / self.temperature
            out.append((logits.float(), valid))
        return out


# -- sampling and the policy gradient ------------------------------------------------------
def gumbel_drops(logits: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Gumbel-max over {keep: 0, drop: logit}: True (drop) with probability sigmoid(logit)."""
    u = torch.rand((2,) + tuple(logits.shape), generator=generator, device=logits.device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    exponential = (-torch.log(u.clamp(min=tiny))).clamp(min=tiny)  # -log u > 0, kept off 0
    gumbel = -torch.log(exponential)
    return logits.float() + gumbel[0] > gumbel[1]


def drop_log_prob(logits: torch.Tensor, drops: torch.Tensor) -> torch.Tensor:
    """log P(action) per unit: log sigmoid(l) where dropped, log sigmoid(-l) where kept."""
    logits = logits.float()
    return torch.where(drops, F.logsigmoid(logits), F.logsigmoid(-logits))


def reinforce_loss(log_probs: torch.Tensor, rewards: torch.Tensor, baseline: float) -> torch.Tensor:
    """Minus Eq. 5's objective: its gradient is -(1/T) sum_t (r_t - b) grad log P(a_t)."""
    advantage = (rewards.float() - baseline).to(log_probs.device)
    return -(advantage * log_probs).mean()


def per_sample_loss(logits: torch.Tensor, target: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Held-out loss of each sample: cross-entropy (B, C), squared error (B,) / (B, 1) with a
    float target, or mean token cross-entropy (B, T, V) over ``keep`` (B, T)."""
    logits = logits.float()
    if logits.dim() == 3:
        keep = target.ne(-100) if keep is None else keep
        nll = F.cross_entropy(logits.transpose(1, 2), target.long().masked_fill(~keep, 0), reduction="none")
        return (nll * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    if target.is_floating_point():
        return (logits.reshape(target.shape) - target.float()) ** 2
    return F.cross_entropy(logits, target.long(), reduction="none")


def win_probability(defender_losses: torch.Tensor, attacker_losses: torch.Tensor) -> torch.Tensor:
    """The Attacker's win rate on the held-out samples (ties count half)."""
    wins = (attacker_losses < defender_losses).float() + 0.5 * (attacker_losses == defender_losses).float()
    return wins.mean()


# -- keeping Defender and Attacker in sync -------------------------------------------------
@torch.no_grad()
def copy_model_state(source: nn.Module, destination: nn.Module) -> None:
    """Overwrite ``destination``'s parameters and buffers in place (optimizers keep their references)."""
    for s, d in zip(source.parameters(), destination.parameters()):
        d.copy_(s)
    for s, d in zip(source.buffers(), destination.buffers()):
        d.copy_(s)


def copy_optimizer_state(source: torch.optim.Optimizer, source_params: Sequence[torch.Tensor],
                         destination: torch.optim.Optimizer, destination_params: Sequence[torch.Tensor]) -> None:
    """Give ``destination`` a copy of ``source``'s per-parameter state (Adam moments, step)."""
    for s, d in zip(source_params, destination_params):
        state = source.state.get(s)
        if state:
            destination.state[d] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        else:
            destination.state.pop(d, None)


# -- the game ------------------------------------------------------------------------------
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

    def __init__(self, config: AttendOutConfig, controller: RegularizationController, generator: Generator,
                 flag: Callable[[str], str] = _flag):
        self.config = config.validate(flag)
        self.sites: List[AttentionSite] = controller.select(
            parse_kinds(config.attention, flag("attention")), parse_layers(config.layers, flag("layers")), flag("layers")
        )
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

    def site_names(self) -> List[str]:
        return [f"{s.kind}.{s.layer}" for s in self.sites]

    # -- during the T updates ------------------------------------------------------------
    def attacker_hooks(self, streams: Dict[str, torch.Tensor]) -> Dict[AttentionSite, EditScores]:
        """Sample this batch's masks; remember how to recompute their log-probability."""
        seed = int(torch.randint(0, 2 ** 62, (1,)).item())  # global CPU generator: seeded per update
        streams = {k: v.detach() for k, v in streams.items()}
        self.cache.append(_CachedBatch(self.update_in_step, streams, seed))
        with torch.no_grad():
            drops, probs = self._sample(streams, seed)
        self._prob_sums = probs if self._prob_sums is None else self._prob_sums + probs
        self._prob_batches += 1
        self._update_probs.append(probs)
        self.last_drop_probabilities = probs  # per site, this batch (a tensor: no host sync)
        return {site: EditScores(drop=d) for site, d in zip(self.sites, drops)}

    def _sample(self, streams, seed, log_prob: bool = False):
        outputs = self.generator.drop_logits(streams, self.sites)
        device = outputs[0][0].device
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
        drops, probs, total, count = [], [], 0.0, 0
        for logits, valid in outputs:
            d = gumbel_drops(logits, rng) & valid
            drops.append(d)
            p = torch.sigmoid(logits)
            probs.append((p * valid).sum() / valid.sum().clamp(min=1))
            if log_prob:
                total = total + (drop_log_prob(logits, d) * valid).sum(dim=(1, 2, 3))
                count = count + valid.sum(dim=(1, 2, 3))
        if log_prob:
            # Per sample: mean over its valid units in all selected layers; then over samples.
            return (total / count.clamp(min=1)).mean()
        return drops, torch.stack(probs).detach()

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

    def finish_dropout_step(self, defender_losses: torch.Tensor, attacker_losses: torch.Tensor,
                            generator: Optional[torch.Generator] = None) -> Dict[str, object]:
        """Reward G (Eq. 5) from per-sample held-out losses, update the baseline, pick the survivor.

        Returns ``{"keep_attacker": bool, "win_rate", "reward", "baseline", "drop_prob": {...}}``;
        the adapter then copies the survivor over the other network.
        """
        rewards = (defender_losses.float() - attacker_losses.float()).detach()
        updates = sorted({c.update for c in self.cache})
        stats: Dict[str, object] = {"drop_prob": self.mean_drop_probabilities()}
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
        # Every worker must draw the same survivor: adapters pass a generator seeded alike on all
        # workers (the global one has consumed worker-dependent amounts of randomness by now).
        keep_attacker = bool(torch.rand((), generator=generator) < win_rate.cpu())
        stats.update(keep_attacker=keep_attacker, win_rate=float(win_rate), reward=mean_reward, baseline=self.baseline)
        self.cache.clear()
        self.update_in_step = 0
        self._prob_sums, self._prob_batches, self._update_probs = None, 0, []
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
            "cache": [{"update": c.update, "streams": {k: v.cpu() for k, v in c.streams.items()}, "seed": c.seed}
                      for c in self.cache],
            "prob_sums": None if self._prob_sums is None else self._prob_sums.cpu(),
            "prob_batches": self._prob_batches,
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        device = next(self.generator.parameters()).device
        self.generator.load_state_dict(state["generator"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.baseline = float(state["baseline"])
        self.update_in_step = int(state["update_in_step"])
        self.dropout_steps_done = int(state["dropout_steps_done"])
        self.cache = [_CachedBatch(int(c["update"]), {k: v.to(device) for k, v in c["streams"].items()}, int(c["seed"]))
                      for c in state["cache"]]
        sums = state["prob_sums"]
        self._prob_sums = None if sums is None else sums.to(device)
        self._prob_batches = int(state["prob_batches"])


class DropProbabilityLog:
    """Appends one JSON line per dropout step: update, per-layer mean drop probability, reward."""

    def __init__(self, path: Optional[str]):
        self.path = path

    def write(self, update: int, stats: Dict[str, object]) -> None:
        if not self.path:
            return
        record = {"update": int(update), **{k: v for k, v in stats.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
