"""AttendOut (Wu, Zhao, Zhang): a learned score-dropout maker trained by a Defender/Attacker game.

Framework-free pieces, one module per idea; adapters (fairseq task, HF Trainer) own the two
networks and their optimizers and call into them:

* :class:`Generator` (G-Net, paper Sec. 4.1): its own token and position embeddings, ONE
  single-head attention whose parameters are shared by all layers, no feed-forward. The
  layer-i attention scores, plus a shared bias and divided by the temperature, are the drop
  logits of the Attacker's layer i; actions are sampled with the Gumbel-max trick, so a unit
  is dropped with probability sigmoid(logit / temperature).
* :mod:`.policy`: the drop logits as factors, the Gumbel-max actions as a drop rule of the kernel
  made per block of query rows (never a (T, S) map), their log-probability block by block, and the
  REINFORCE loss; :mod:`.heldout`: per-sample
  held-out losses and the win rate; :mod:`.sync`: copying the survivor over the other network.
* :class:`AttendOut` (:mod:`.game`): per training batch, the Attacker's masks (paper Eq. 3; a row whose every
  real key is dropped attends uniformly, Eq. 4, done in the kernel); every T updates the
  REINFORCE update of Eq. 5 with a moving-average baseline from per-sample rewards on T
  held-out samples, and the probabilistic choice of the survivor that re-syncs both networks.
* :mod:`.duel`: the Defender/Attacker steps every framework runs alike (build the Attacker,
  score both on held-out batches, end a dropout step, tell a step the loss scaler skipped);
  :mod:`.log`: the JSONL log.
"""

from .config import AttendOutConfig
from .duel import build_attacker, end_dropout_step, scaler_skipped_step
from .game import AttendOut
from .generator import STREAMS_OF_KIND, Generator, real_key
from .heldout import heldout_indices, heldout_losses, per_sample_loss, win_probability
from .log import DropProbabilityLog
from .policy import GeneratorRule, PolicyLogits, action_log_prob, drop_log_prob, gumbel_drops, reinforce_loss
from .sync import copy_model_state, copy_optimizer_state

__all__ = [
    "AttendOut",
    "AttendOutConfig",
    "DropProbabilityLog",
    "Generator",
    "GeneratorRule",
    "PolicyLogits",
    "action_log_prob",
    "STREAMS_OF_KIND",
    "build_attacker",
    "copy_model_state",
    "copy_optimizer_state",
    "drop_log_prob",
    "heldout_indices",
    "end_dropout_step",
    "gumbel_drops",
    "heldout_losses",
    "per_sample_loss",
    "real_key",
    "reinforce_loss",
    "scaler_skipped_step",
    "win_probability",
]
