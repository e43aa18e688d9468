"""AttendOut for transformers' Trainer: :class:`AttendOutTrainer`, :class:`AttendOutSeq2SeqTrainer`.

Same semantics as the fairseq task option ``--attendout``; the science is in
``attn_reg_plugin.core`` (the game and the duel's shared steps in ``core.attendout``).

* the Defender D is the Trainer's model, trained exactly as the Trainer trains it (regular
  dropout, the Trainer's loss, optimizer, scheduler and ``max_grad_norm`` clipping);
* the Attacker A is a copy of D whose attention takes the generator's score-dropout masks. It
  has its own optimizer, of the Trainer's optimizer class with the same parameter groups and
  hyperparameters; its learning rate is copied from the Trainer's optimizer at every step (so
  the Trainer's scheduler drives both) and its gradients are clipped to the same
  ``max_grad_norm``. A trains on D's batches: its forward/backward runs in the same training
  step, right after D's, through the Trainer's own ``training_step`` (same loss, same
  gradient-accumulation scaling);
* every T optimizer steps, T samples drawn at random (torch's global generator) from
  ``eval_dataset`` are scored by D and A in eval mode (per-sample cross-entropy, squared error
  for regression); the generator takes its REINFORCE step and the survivor's parameters *and*
  optimizer state overwrite the other's, so D and A start every dropout step identical and the
  model the Trainer saves is the survivor.

Gradient accumulation is supported (the masks of every micro-batch of an update are cached; an
update's log-probability is their mean). Mixed precision: A's forward runs under the Trainer's
autocast, as D's does. With fp16, A has a loss scaler of its own (a copy of the Trainer's
scaler's settings), so each network skips its own overflowing steps: when D's step is skipped,
the update still counts (the Trainer counts it too) and A steps unless its own gradients
overflowed; when A's step is skipped, D steps, and ``attendout_attacker_overflows`` is logged.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any, Dict, List, Optional

import torch
import transformers
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..core.ad_drop import bare_module
from ..core.attendout import (
    AttendOut,
    AttendOutConfig,
    DropProbabilityLog,
    Generator,
    build_attacker,
    copy_model_state,
    copy_optimizer_state,
    end_dropout_step,
    heldout_indices,
    scaler_skipped_step,
)
from ..core.controller import RegularizationController
from ..core.distributed import all_reduce_mean_, is_distributed, rank
from ..core.options import named_by_field
from ..core.sharding import (
    full_state_dicts,
    is_fully_sharded,
    load_full_state_dicts,
    meta_copy,
    reshard,
    shard_like,
)
from .attention import install_attention_sites
from .model_inputs import causal_lm, decoder_input_ids_from_labels
from .training_configurations import model_argument, refuse_unsupported, refuse_unsupported_launch, training_arguments

logger = logging.getLogger(__name__)

ATTENDOUT_STATE = "attendout.pt"  # in each checkpoint folder: Attacker, its optimizer, the game
FULL_OPTIMIZER_STATE = "attacker_optimizer_by_name"  # a sharded Attacker's optimizer state, gathered


def _raw_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's AcceleratedOptimizer wrapper."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_like(optimizer, source: torch.nn.Module, twin: torch.nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class, same parameter groups and hyperparameters, on ``twin``'s parameters.

    ``twin`` is a copy of ``source`` (same parameter order). FSDP2 models are resharded first: an
    optimizer holds the sharded parameters, which a model lists only while no forward holds them gathered.
    """
    reshard(source)
    reshard(twin)
    raw = _raw_optimizer(optimizer)
    twin_of = {id(s): t for s, t in zip(source.parameters(), twin.parameters())}
    groups = []
    for group in raw.param_groups:
        missing = [p for p in group["params"] if id(p) not in twin_of]
        if missing:
            raise ValueError(
                "AttendOut: the Trainer's optimizer holds parameters that are not the model's; "
                "the Attacker's optimizer cannot mirror it"
            )
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": [twin_of[id(p)] for p in group["params"]]}
        )
    # defaults only fill keys a group lacks (none here); pass those the constructor accepts.
    accepted = inspect.signature(type(raw)).parameters
    defaults = {k: v for k, v in raw.defaults.items() if k in accepted}
    try:
        return type(raw)(groups, **defaults)
    except TypeError as err:
        raise TypeError(
            f"AttendOut cannot build the Attacker's optimizer as a {type(raw).__name__} like the Trainer's: {err}"
        ) from None


def mirror_activation_checkpointing(source: torch.nn.Module, destination: torch.nn.Module) -> None:
    """Give ``destination``'s layers ``source``'s activation-checkpointing flags (transformers' layer
    attributes, set by the Trainer on D after the Attacker's skeleton was taken)."""
    modules = dict(destination.named_modules())
    for path, module in source.named_modules():
        for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
            if name in module.__dict__:
                setattr(modules[path], name, module.__dict__[name])


class _AttendOutCallback(TrainerCallback):
    """A's step right after D's (before the scheduler moves the learning rate), the dropout step after the update."""

    def __init__(self, trainer: AttendOutTrainerMixin):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._attendout_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._attendout_step_end()


class AttendOutTrainerMixin:
    """Shared by :class:`AttendOutTrainer` and :class:`AttendOutSeq2SeqTrainer`."""

    def __init__(self, *args, attendout: AttendOutConfig, attendout_log_file: Optional[str] = None, **kwargs):
        if not isinstance(attendout, AttendOutConfig):
            raise TypeError(f"attendout must be an AttendOutConfig, got {type(attendout).__name__}")
        named_by_field(attendout).validate()
        model = model_argument("AttendOutTrainer", args, kwargs)
        refuse_unsupported("AttendOutTrainer", training_arguments(args, kwargs), model=model)
        if is_fully_sharded(model):
            raise ValueError(
                "AttendOutTrainer needs the unsharded model (it was sharded with FSDP2 before the Trainer was built): "
                "the Attacker is a copy of it, and a sharded module cannot be copied. Pass the unsharded model and "
                "let the Trainer shard it (fsdp_config={'version': 2})"
            )
        super().__init__(*args, **kwargs)
        refuse_unsupported_launch("AttendOutTrainer", self)  # what accelerate's own config turned on, too
        self._attendout_heldout_dataset = self._attendout_check_eval_dataset()
        config = model.config
        if getattr(config, "problem_type", None) == "multi_label_classification":
            raise ValueError("AttendOutTrainer: multi-label classification has no per-sample held-out loss here")
        if config.pad_token_id is None:
            raise ValueError("AttendOutTrainer needs model.config.pad_token_id: the generator skips padding tokens")
        self.attendout_config = attendout
        self.attendout_log = DropProbabilityLog(attendout_log_file)
        # D's attention goes through the same kernel as A's (idle here: transformers' sdpa).
        self.attendout_defender_controller = RegularizationController()
        install_attention_sites(model, self.attendout_defender_controller)
        # A's skeleton (parameters on the meta device, no memory): under FSDP2 the Trainer shards D
        # before the first step, and A is then built from this, sharded like D (see _attendout_start).
        self._attendout_skeleton: Optional[torch.nn.Module] = meta_copy(model)
        self._attendout_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        # A decoder-only LM: its one token stream is the generator's "target" (decoder-self) stream,
        # and held-out losses compare logits t with labels t + 1, as the model's own loss does.
        self._attendout_decoder_only = (
            not self._attendout_encoder_decoder and self.attendout_defender_controller.num_layers("encoder-self") == 0
        )
        self._attendout_causal_lm = causal_lm(model)
        sizes, self._attendout_start_id, shared = self._attendout_vocab(model)
        # A fork: the generator's random init must not shift the Trainer's seeded stream.
        with torch.random.fork_rng(devices=[]):
            self.attendout_generator = Generator(
                sizes,
                {s: config.pad_token_id for s in sizes},
                attendout.generator_dim,
                attendout.max_positions,
                attendout.init_drop,
                attendout.temperature,
                share_streams=shared,
                positions_option=attendout.name("max_positions"),
            )
        # Selecting the sites now checks kinds and layers against the model, before training.
        AttendOut(attendout, self.attendout_defender_controller, self.attendout_generator)
        self.attendout_attacker: Optional[torch.nn.Module] = None
        self.attendout_optimizer: Optional[torch.optim.Optimizer] = None
        self.attendout_scaler: Optional[torch.amp.GradScaler] = None  # A's own fp16 loss scaler
        self._attendout_overflows = 0  # A's steps skipped since the last log
        self.attendout_game: Optional[AttendOut] = None
        self._attendout_resume_from: Optional[str] = None
        self._attendout_finish_due = False
        self._attendout_loss_sum: Any = 0.0
        self._attendout_loss_updates = 0
        self.add_callback(_AttendOutCallback(self))

    # -- set-up ---------------------------------------------------------------------------
    def _attendout_check_eval_dataset(self):
        dataset = self.eval_dataset
        if dataset is None:
            raise ValueError(
                "AttendOutTrainer needs eval_dataset: the held-out samples of every dropout step are drawn from it"
            )
        if isinstance(dataset, dict):
            raise ValueError(
                "AttendOutTrainer needs one eval_dataset (not a dict): it draws the held-out samples from it"
            )
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "AttendOutTrainer needs an eval_dataset with len() and indexing (held-out samples are drawn at random)"
            )
        if len(dataset) == 0:
            raise ValueError("AttendOutTrainer: eval_dataset is empty; AttendOut needs held-out samples")
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                return self._remove_unused_columns(dataset, description="AttendOut held-out")
        except ImportError:
            pass
        return dataset

    def _attendout_vocab(self, model):
        """Generator table sizes per stream, the id it reads for the decoder start, whether streams share a table."""

        def size(module, fallback):
            get = getattr(module, "get_input_embeddings", None)
            emb = get() if callable(get) else None
            return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else fallback

        config = model.config
        if self._attendout_decoder_only:
            return {"target": size(model, config.vocab_size)}, None, False
        if not self._attendout_encoder_decoder:
            return {"source": size(model, config.vocab_size)}, None, False
        encoder, decoder = model.get_encoder(), model.get_decoder()
        source = size(encoder, config.vocab_size)
        target = size(decoder, getattr(config, "decoder_vocab_size", None) or config.vocab_size)
        enc_emb, dec_emb = encoder.get_input_embeddings(), decoder.get_input_embeddings()
        shared = enc_emb is not None and dec_emb is not None and enc_emb.weight is dec_emb.weight
        # One extra row: the generator reads position 0 of the decoder input as its own "start"
        # token, since Marian's decoder start token *is* its pad token.
        if shared:
            return {"source": source + 1, "target": source + 1}, source, True
        return {"source": source, "target": target + 1}, target, False

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # None: the Trainer raises its own error
        # Any path the Trainer accepts (str or os.PathLike, e.g. pathlib.Path) resumes the game too.
        self._attendout_resume_from = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _attendout_start(self) -> None:
        """Build A (a copy of D as it is now), its optimizer and the game; restore them on resume."""
        if self.attendout_attacker is None:
            defender = bare_module(self.model)
            if is_fully_sharded(defender):
                attacker, controller = self._attendout_sharded_attacker(defender)
            else:
                attacker, controller = build_attacker(defender, install_attention_sites)
            self._attendout_skeleton = None
            if self.args.torch_compile:
                # Compiled like D, in place (parameter names unchanged); its masks are tensors, so
                # the graph does not change from one batch to the next.
                attacker.compile(**self.accelerator.state.dynamo_plugin.to_kwargs())
            self.attendout_generator.to(next(defender.parameters()).device)
            self.attendout_game = AttendOut(self.attendout_config, controller, self.attendout_generator)
            self.attendout_optimizer = optimizer_like(self.optimizer, defender, attacker)
            self.attendout_attacker = attacker
            scaler = self.accelerator.scaler
            if scaler is not None:
                # Same settings and starting scale as D's scaler; from here on it follows A's gradients.
                self.attendout_scaler = torch.amp.GradScaler(scaler._device)
                self.attendout_scaler.load_state_dict(scaler.state_dict())
        if self._attendout_resume_from is not None:
            folder, self._attendout_resume_from = self._attendout_resume_from, None
            self._attendout_load(folder)

    def _attendout_sharded_attacker(self, defender: torch.nn.Module):
        """A under FSDP2: the skeleton sharded like D, only this rank's shards allocated, D's weights
        and buffers copied in, D's activation-checkpointing flags mirrored, then its own sites (the
        probe forward runs on every rank at once, as the first step does)."""
        attacker = self._attendout_skeleton
        shard_like(defender, attacker)
        attacker.to_empty(device=next(defender.parameters()).device)
        copy_model_state(defender, attacker)
        mirror_activation_checkpointing(defender, attacker)
        controller = RegularizationController()
        install_attention_sites(attacker, controller)
        return attacker, controller

    # -- per micro-batch ------------------------------------------------------------------
    def attendout_streams(self, inputs: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """The generator's token streams: {"source": encoder tokens} (+ {"target": decoder inputs} for seq2seq);
        a decoder-only LM's tokens are its {"target"} stream. A model whose encoder reads features (Whisper)
        has no source stream: its decoder-self attention can still be regularized."""
        pad = self.model.config.pad_token_id
        ids = inputs.get("input_ids")
        streams = {}
        if ids is not None:
            mask = inputs.get("attention_mask")
            # Padding as the model sees it (attention_mask), whatever id the collator padded with.
            tokens = ids if mask is None or mask.dim() != 2 else ids.masked_fill(mask.eq(0), pad)
            streams["target" if self._attendout_decoder_only else "source"] = tokens
        elif not self._attendout_encoder_decoder or any(s.kind != "decoder-self" for s in self.attendout_game.sites):
            raise ValueError(
                "AttendOutTrainer needs input_ids in every training batch: the generator reads the tokens"
                + (
                    " (this model's encoder reads features, so only --attention decoder-self can be regularized: "
                    "AttendOutConfig(attention='decoder-self'))"
                    if self._attendout_encoder_decoder
                    else ""
                )
            )
        if self._attendout_encoder_decoder:
            target = inputs.get("decoder_input_ids")
            if target is None:
                labels = inputs.get("labels")
                if labels is None:
                    raise ValueError(
                        "AttendOutSeq2SeqTrainer needs labels or decoder_input_ids in every training batch"
                    )
                target = decoder_input_ids_from_labels(bare_module(self.model), labels)
            dmask = inputs.get("decoder_attention_mask")
            if dmask is not None and dmask.dim() == 2:
                target = target.masked_fill(dmask.eq(0), pad)
            target = target.clone()
            target[:, 0] = self._attendout_start_id
            streams["target"] = target
        return streams

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self._prepare_inputs(inputs)  # once: the steps below find it on the device already
        loss = super().training_step(model, dict(inputs), num_items_in_batch)
        self._attendout_start()
        hooks = self.attendout_game.attacker_hooks(self.attendout_streams(inputs))
        # The Trainer's own step on A: same loss, same gradient-accumulation scaling, under the
        # Trainer's autocast (D's forward is wrapped in it by accelerate).
        with (
            self.attendout_game.controller.hooks(hooks),
            self.accelerator.autocast(),
            self._attendout_backward_scaler(),
        ):
            attacker_loss = super().training_step(self.attendout_attacker, dict(inputs), num_items_in_batch)
        self._attendout_loss_sum = self._attendout_loss_sum + attacker_loss
        return loss

    @contextlib.contextmanager
    def _attendout_backward_scaler(self):
        """A's backward, run by the Trainer's own training_step, scales its loss with A's scaler."""
        if self.attendout_scaler is None:
            yield
            return
        accelerator = self.accelerator
        own, accelerator.scaler = accelerator.scaler, self.attendout_scaler
        try:
            yield
        finally:
            accelerator.scaler = own

    # -- per update (callback) ------------------------------------------------------------
    def _attendout_optimizer_step(self) -> None:
        if self.attendout_attacker is None:
            return
        params = [p for p in self.attendout_attacker.parameters() if p.requires_grad]
        if not is_fully_sharded(self.attendout_attacker):  # FSDP2 reduce-scattered them already
            all_reduce_mean_([p.grad for p in params if p.grad is not None])  # D's grads: averaged by DDP
        scaler = self.attendout_scaler
        if scaler is not None:
            scaler.unscale_(self.attendout_optimizer)  # clip the true gradients
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)
        for mine, theirs in zip(self.attendout_optimizer.param_groups, _raw_optimizer(self.optimizer).param_groups):
            mine["lr"] = theirs["lr"]  # the lr D just stepped with; the scheduler moves it next
        if scaler is None:
            self.attendout_optimizer.step()
        else:
            scale = scaler.get_scale()
            scaler.step(self.attendout_optimizer)  # skipped when A's gradients are not finite
            scaler.update()
            self._attendout_overflows += int(scaler_skipped_step(scaler, scale))
        self.attendout_optimizer.zero_grad(set_to_none=True)
        self._attendout_loss_updates += 1
        self._attendout_finish_due = self.attendout_game.end_update()

    def _attendout_step_end(self) -> None:
        if self._attendout_finish_due:
            self._attendout_finish_due = False
            self._attendout_finish_dropout_step()

    # -- every T updates ------------------------------------------------------------------
    def _attendout_heldout_batches(self) -> List[Dict[str, Any]]:
        dataset = self._attendout_heldout_dataset
        n, T = len(dataset), self.attendout_config.dropout_step
        idx = heldout_indices(n, T)  # rank 0's draw: the same samples everywhere
        collate = self.data_collator
        try:
            import datasets

            plain = not isinstance(dataset, datasets.Dataset)
        except ImportError:
            plain = True
        if plain:
            collate = self._get_collator_with_removed_columns(collate, description="AttendOut held-out")
        return [
            self._prepare_inputs(collate([dataset[int(i)] for i in chunk]))
            for chunk in idx.split(self.args.eval_batch_size)
        ]

    def _attendout_logits(self, model: torch.nn.Module, batch):
        """(logits, target, keep) of a held-out batch, as the Trainer's autocast computes them."""
        labels = batch.get("labels")
        if labels is None:
            raise ValueError(
                "AttendOutTrainer scores held-out samples by their loss: eval_dataset batches need `labels`"
            )
        with self.accelerator.autocast():
            outputs = model(**batch)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
        if logits.dim() == 2 and logits.shape[-1] == 1:
            labels = labels.float()  # num_labels == 1: regression, as transformers treats it
        if self._attendout_causal_lm:  # position t predicts label t + 1
            return logits[:, :-1], labels[:, 1:], None
        return logits, labels, None

    def _attendout_finish_dropout_step(self) -> Dict[str, object]:
        defender, attacker = bare_module(self.model), self.attendout_attacker
        sides = {
            "defender": (defender, _raw_optimizer(self.optimizer)),
            "attacker": (attacker, self.attendout_optimizer),
        }

        def copy_network(source: str, destination: str) -> None:  # weights and optimizer state
            (s_model, s_opt), (d_model, d_opt) = sides[source], sides[destination]
            copy_model_state(s_model, d_model)
            copy_optimizer_state(s_opt, list(s_model.parameters()), d_opt, list(d_model.parameters()))

        stats = end_dropout_step(
            self.attendout_game,
            defender,
            attacker,
            self._attendout_heldout_batches(),
            self._attendout_logits,
            copy_network,
        )
        logs = {f"attendout_p_{name}": p for name, p in stats["drop_prob"].items()}
        logs.update(
            attendout_dropout_step=self.attendout_game.dropout_steps_done,
            attendout_win_rate=stats["win_rate"],
            attendout_drop_rate=stats["drop_rate"],  # what the kernel applied to the Attacker
            attendout_kept_attacker=float(stats["keep_attacker"]),
            attendout_reward=stats["reward"],
            attendout_baseline=stats["baseline"],
        )
        # Trainer.log clears control.should_log; keep it so this update's training log still happens.
        should_log = self.control.should_log
        self.log(logs)
        self.control.should_log = should_log
        if self.is_world_process_zero():
            self.attendout_log.write(self.state.global_step, stats)
        return stats

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._attendout_loss_updates:  # a training log: A's loss in the same units
            total = torch.as_tensor(self._attendout_loss_sum).detach().clone()
            all_reduce_mean_([total])  # like the Trainer's "loss": averaged over workers
            logs["attendout_attacker_loss"] = float(total) / self._attendout_loss_updates
            self._attendout_loss_sum, self._attendout_loss_updates = 0.0, 0
            if self.attendout_scaler is not None:
                logs["attendout_attacker_overflows"] = self._attendout_overflows
                self._attendout_overflows = 0
        return super().log(logs, *args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------
    def attendout_state_dict(self) -> Dict[str, object]:
        """A, its optimizer, the game (and A's loss scaler). Under FSDP2, A and its optimizer state are
        gathered into full tensors on the CPU (a collective: every rank calls this), keyed by
        parameter name, so the file does not depend on the number of ranks."""
        if is_fully_sharded(self.attendout_attacker):
            attacker, optimizer = full_state_dicts(self.attendout_attacker, self.attendout_optimizer)
            optimizer_key = FULL_OPTIMIZER_STATE
        else:
            attacker, optimizer = self.attendout_attacker.state_dict(), self.attendout_optimizer.state_dict()
            optimizer_key = "attacker_optimizer"
        return {
            "attacker": attacker,
            optimizer_key: optimizer,
            "game": self.attendout_game.state_dict(),
            **({"attacker_scaler": self.attendout_scaler.state_dict()} if self.attendout_scaler is not None else {}),
        }

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.attendout_attacker is None or self.args.save_only_model:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = self.attendout_state_dict()  # on every rank: gathering a sharded A is a collective
        if self.args.should_save:
            torch.save(state, os.path.join(folder, ATTENDOUT_STATE))
        if is_distributed():  # each worker caches its own batches
            torch.save(self.attendout_game.state_dict(), os.path.join(folder, f"attendout_game_rank{rank()}.pt"))

    def _attendout_load(self, folder: str) -> None:
        path = os.path.join(folder, ATTENDOUT_STATE)
        if not os.path.isfile(path):
            logger.warning(
                f"{folder} has no {ATTENDOUT_STATE}: AttendOut starts a new game from the loaded model "
                "(Attacker = Defender, fresh generator)"
            )
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if is_fully_sharded(self.attendout_attacker) or FULL_OPTIMIZER_STATE in state:
            if FULL_OPTIMIZER_STATE not in state:
                raise ValueError(
                    f"{path} was saved by an unsharded run: its Attacker optimizer state is indexed by position and "
                    "cannot be sharded. Resume it without FSDP, or start a new AttendOut game from the model"
                )
            load_full_state_dicts(
                self.attendout_attacker, self.attendout_optimizer, state["attacker"], state[FULL_OPTIMIZER_STATE]
            )
        else:
            self.attendout_attacker.load_state_dict(state["attacker"])
            self.attendout_optimizer.load_state_dict(state["attacker_optimizer"])
        if self.attendout_scaler is not None and "attacker_scaler" in state:
            self.attendout_scaler.load_state_dict(state["attacker_scaler"])
        game = state["game"]
        if is_distributed():
            mine = os.path.join(folder, f"attendout_game_rank{rank()}.pt")
            if os.path.isfile(mine):
                game = torch.load(mine, map_location="cpu", weights_only=True)
        self.attendout_game.load_state_dict(game)


class AttendOutTrainer(AttendOutTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with AttendOut; keywords ``attendout: AttendOutConfig``, ``attendout_log_file``."""


class AttendOutSeq2SeqTrainer(AttendOutTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with AttendOut; keywords ``attendout: AttendOutConfig``, ``attendout_log_file``."""
