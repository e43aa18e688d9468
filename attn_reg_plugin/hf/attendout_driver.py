"""The AttendOut game as the Trainer runs it: :class:`AttendOutDriver`, the per-run state the trainer owns.

* at the first training step it builds the Attacker A (a copy of D as it is then), A's optimizer
  (:func:`optimizer_like` the Trainer's), A's fp16 loss scaler and the game, and restores them on resume;
* per micro-batch it gives the generator D's token streams and wraps the Trainer's own step on A;
* per update it steps A's optimizer, right after D's;
* every T updates it scores D and A on held-out samples, takes the generator's step and copies the
  survivor over the other network.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict, List, Optional

import torch

from ..core.kernel.controller import RegularizationController
from ..core.regularizers.attendout import (
    AttendOut,
    AttendOutConfig,
    Generator,
    build_attacker,
    copy_model_state,
    copy_optimizer_state,
    end_dropout_step,
    heldout_indices,
    scaler_skipped_step,
)
from ..core.regularizers.attendout.config import generator_positions
from ..core.regularizers.attendout.generator import real_key
from ..core.regularizers.attribution_pass import bare_module
from ..core.training.distributed import all_reduce_mean_
from ..core.training.sharding import is_fully_sharded, meta_copy, reshard, shard_like
from .attendout_checkpoint import load_attendout_state
from .attendout_heldout import heldout_dataset
from .attendout_logging import AttendOutLogs
from .attention import install_attention_sites
from .model_inputs import causal_lm, decoder_input_ids_from_labels


def raw_optimizer(optimizer) -> torch.optim.Optimizer:
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
    raw = raw_optimizer(optimizer)
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


def model_max_length(config) -> Optional[int]:
    """The longest input the model's config states it takes (None: it states none, e.g. T5)."""
    names = ("max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions")
    lengths = [getattr(config, name, None) for name in names]
    return max((n for n in lengths if isinstance(n, int) and n > 0), default=None)


def generator_vocab(model, encoder_decoder: bool, decoder_only: bool):
    """Generator table sizes per stream, the id it reads for the decoder start, whether streams share a table."""

    def size(module, fallback):
        get = getattr(module, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else fallback

    config = model.config
    if decoder_only:
        return {"target": size(model, config.vocab_size)}, None, False
    if not encoder_decoder:
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


class AttendOutDriver:
    """The game's per-run state and steps, for the trainer that owns it (its model is D)."""

    def __init__(
        self,
        trainer,
        model: torch.nn.Module,
        config: AttendOutConfig,
        log_file: Optional[str],
        valid_subset: Optional[str] = None,
    ):
        self.trainer = trainer
        self.heldout_dataset = heldout_dataset(trainer, valid_subset)
        model_config = model.config
        if getattr(model_config, "problem_type", None) == "multi_label_classification":
            raise ValueError("AttendOutTrainer: multi-label classification has no per-sample held-out loss here")
        if model_config.pad_token_id is None:
            raise ValueError("AttendOutTrainer needs model.config.pad_token_id: the generator skips padding tokens")
        self.config = config
        self.logs = AttendOutLogs(log_file)
        # D's attention goes through the same kernel as A's (idle here: transformers' sdpa).
        self.defender_controller = RegularizationController()
        self.found_sites = install_attention_sites(model, self.defender_controller)
        # A's skeleton (parameters on the meta device, no memory): under FSDP2 the Trainer shards D
        # before the first step, and A is then built from this, sharded like D (see start).
        self.skeleton: Optional[torch.nn.Module] = meta_copy(model)
        self.encoder_decoder = bool(getattr(model_config, "is_encoder_decoder", False))
        # A decoder-only LM: its one token stream is the generator's "target" (decoder-self) stream,
        # and held-out losses compare logits t with labels t + 1, as the model's own loss does.
        self.decoder_only = not self.encoder_decoder and self.defender_controller.num_layers("encoder-self") == 0
        self.causal_lm = causal_lm(model)
        sizes, self.start_id, shared = generator_vocab(model, self.encoder_decoder, self.decoder_only)
        # A fork: the generator's random init must not shift the Trainer's seeded stream.
        with torch.random.fork_rng(devices=[]):
            self.generator = Generator(
                sizes,
                {s: model_config.pad_token_id for s in sizes},
                config.generator_dim,
                generator_positions(config, model_max_length(model_config)),
                config.init_drop,
                config.temperature,
                share_streams=shared,
                positions_option=config.name("max_positions"),
            )
        # Selecting the sites now checks kinds and layers against the model, before training.
        self.sites = AttendOut(config, self.defender_controller, self.generator).sites
        self.attacker: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scaler: Optional[torch.amp.GradScaler] = None  # A's own fp16 loss scaler
        self.game: Optional[AttendOut] = None
        self.resume_from: Optional[str] = None  # a checkpoint folder to restore the game from at start
        self.dropout_step_due = False
        self._attacker_pass: Optional[contextlib.ExitStack] = None  # the open pass of A's step

    # -- set-up ---------------------------------------------------------------------------
    def start(self) -> None:
        """Build A (a copy of D as it is now), its optimizer and the game; restore them on resume."""
        if self.attacker is None:
            self._build_attacker()
        if self.resume_from is not None:
            folder, self.resume_from = self.resume_from, None
            load_attendout_state(self, folder)

    def _build_attacker(self) -> None:
        trainer = self.trainer
        defender = bare_module(trainer.model)
        if is_fully_sharded(defender):
            attacker, controller = self._sharded_attacker(defender)
        else:
            attacker, controller = build_attacker(defender, install_attention_sites)
        self.skeleton = None
        if trainer.args.torch_compile:
            # Compiled like D, in place (parameter names unchanged); its masks are tensors, so
            # the graph does not change from one batch to the next.
            attacker.compile(**trainer.accelerator.state.dynamo_plugin.to_kwargs())
        self.generator.to(next(defender.parameters()).device)
        self.game = AttendOut(self.config, controller, self.generator)
        self.optimizer = optimizer_like(trainer.optimizer, defender, attacker)
        self.attacker = attacker
        scaler = trainer.accelerator.scaler
        if scaler is not None:
            # Same settings and starting scale as D's scaler; from here on it follows A's gradients.
            self.scaler = torch.amp.GradScaler(scaler._device)
            self.scaler.load_state_dict(scaler.state_dict())

    def _sharded_attacker(self, defender: torch.nn.Module):
        """A under FSDP2: the skeleton sharded like D, only this rank's shards allocated, D's weights
        and buffers copied in, D's activation-checkpointing flags mirrored, then its own sites (the
        probe forward runs on every rank at once, as the first step does)."""
        attacker = self.skeleton
        shard_like(defender, attacker)
        attacker.to_empty(device=next(defender.parameters()).device)
        copy_model_state(defender, attacker)
        mirror_activation_checkpointing(defender, attacker)
        controller = RegularizationController()
        install_attention_sites(attacker, controller)
        return attacker, controller

    # -- per micro-batch ------------------------------------------------------------------
    def streams(self, inputs: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """The generator's token streams: {"source": encoder tokens} (+ {"target": decoder inputs} for seq2seq);
        a decoder-only LM's tokens are its {"target"} stream. A model whose encoder reads features (Whisper)
        has no source stream: its decoder-self attention can still be regularized. Beside each, its real
        tokens (:func:`~attn_reg_plugin.core.regularizers.attendout.generator.real_key`) as the model sees them: its
        attention mask, every token without one; never the token ids (an LM's pad token is often its EOS)."""
        pad = self.trainer.model.config.pad_token_id
        ids = inputs.get("input_ids")
        streams = {}
        if ids is not None:
            mask = inputs.get("attention_mask")
            # Padding as the model sees it (attention_mask), whatever id the collator padded with.
            stream = "target" if self.decoder_only else "source"
            streams[stream] = ids if mask is None or mask.dim() != 2 else ids.masked_fill(mask.eq(0), pad)
            if mask is None or mask.dim() == 2:
                streams[real_key(stream)] = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.ne(0)
        elif not self.encoder_decoder or any(s.kind != "decoder-self" for s in self.game.sites):
            raise ValueError(
                "AttendOutTrainer needs input_ids in every training batch: the generator reads the tokens"
                + (
                    " (this model's encoder reads features, so only --attention decoder-self can be regularized: "
                    "AttendOutConfig(attention='decoder-self'))"
                    if self.encoder_decoder
                    else ""
                )
            )
        if self.encoder_decoder:
            streams["target"] = self._decoder_stream(inputs, pad)
            dmask = inputs.get("decoder_attention_mask")
            if dmask is not None and dmask.dim() == 2:
                streams[real_key("target")] = dmask.ne(0)
        return streams

    def _decoder_stream(self, inputs: Dict[str, Any], pad: int) -> torch.Tensor:
        """The decoder inputs, padding as the model sees it, position 0 the generator's start id."""
        target = inputs.get("decoder_input_ids")
        if target is None:
            labels = inputs.get("labels")
            if labels is None:
                raise ValueError("AttendOutSeq2SeqTrainer needs labels or decoder_input_ids in every training batch")
            target = decoder_input_ids_from_labels(bare_module(self.trainer.model), labels)
        dmask = inputs.get("decoder_attention_mask")
        if dmask is not None and dmask.dim() == 2:
            target = target.masked_fill(dmask.eq(0), pad)
        target = target.clone()
        target[:, 0] = self.start_id
        return target

    @contextlib.contextmanager
    def attacker_step(self, inputs: Dict[str, Any]):
        """Around the Trainer's own training step on A: the generator's masks on A's attention until
        A's loss is made (:meth:`end_attacker_pass`), the Trainer's autocast (D's forward is wrapped in
        it by accelerate) and A's loss scaler."""
        with contextlib.ExitStack() as stack:
            # Through the trainer: a subclass that overrides attendout_streams is heard.
            stack.enter_context(self.game.attacker_pass(self.trainer.attendout_streams(inputs)))
            self._attacker_pass = stack.pop_all()
        try:
            with self.trainer.accelerator.autocast(), self._backward_scaler():
                yield
        finally:
            self.end_attacker_pass()

    def end_attacker_pass(self) -> None:
        """End this step's pass on A, if still open. The trainer's ``compute_loss`` ends it once A's
        loss is made, so what a subclass's ``compute_loss`` runs after ``super()`` (a no-grad forward
        for a metric) is ordinary attention, as with the other trainers; a ``compute_loss`` that never
        calls ``super()`` keeps the masks over the whole step."""
        open_pass, self._attacker_pass = self._attacker_pass, None
        if open_pass is not None:
            open_pass.close()

    @contextlib.contextmanager
    def _backward_scaler(self):
        """A's backward, run by the Trainer's own training_step, scales its loss with A's scaler."""
        if self.scaler is None:
            yield
            return
        accelerator = self.trainer.accelerator
        own, accelerator.scaler = accelerator.scaler, self.scaler
        try:
            yield
        finally:
            accelerator.scaler = own

    # -- per update -----------------------------------------------------------------------
    def optimizer_step(self) -> None:
        """A's step, right after D's and before the scheduler moves the learning rate."""
        if self.attacker is None:
            return
        args = self.trainer.args
        params = [p for p in self.attacker.parameters() if p.requires_grad]
        if not is_fully_sharded(self.attacker):  # FSDP2 reduce-scattered them already
            all_reduce_mean_([p.grad for p in params if p.grad is not None])  # D's grads: averaged by DDP
        scaler = self.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # clip the true gradients
        if args.max_grad_norm is not None and args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        for mine, theirs in zip(self.optimizer.param_groups, raw_optimizer(self.trainer.optimizer).param_groups):
            mine["lr"] = theirs["lr"]  # the lr D just stepped with; the scheduler moves it next
        overflowed = False
        if scaler is None:
            self.optimizer.step()
        else:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)  # skipped when A's gradients are not finite
            scaler.update()
            overflowed = scaler_skipped_step(scaler, scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.logs.count_update(overflowed)
        self.dropout_step_due = self.game.end_update()

    def take_due_dropout_step(self) -> bool:
        """Whether the update just ended closes a dropout step (asked once, at the update's end)."""
        due, self.dropout_step_due = self.dropout_step_due, False
        return due

    # -- every T updates ------------------------------------------------------------------
    def heldout_batches(self) -> List[Dict[str, Any]]:
        trainer = self.trainer
        dataset = self.heldout_dataset
        n, T = len(dataset), self.config.dropout_step
        idx = heldout_indices(n, T)  # rank 0's draw: the same samples everywhere
        collate = trainer.data_collator
        try:
            import datasets

            plain = not isinstance(dataset, datasets.Dataset)
        except ImportError:
            plain = True
        if plain:
            collate = trainer._get_collator_with_removed_columns(collate, description="AttendOut held-out")
        return [
            trainer._prepare_inputs(collate([dataset[int(i)] for i in chunk]))
            for chunk in idx.split(trainer.args.eval_batch_size)
        ]

    def heldout_logits(self, model: torch.nn.Module, batch):
        """(logits, target, keep) of a held-out batch, as the Trainer's autocast computes them."""
        labels = batch.get("labels")
        if labels is None:
            raise ValueError(
                "AttendOutTrainer scores held-out samples by their loss: eval_dataset batches need `labels`"
            )
        with self.trainer.accelerator.autocast():
            outputs = model(**batch)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
        if logits.dim() == 2 and logits.shape[-1] == 1:
            labels = labels.float()  # num_labels == 1: regression, as transformers treats it
        if self.causal_lm:  # position t predicts label t + 1
            return logits[:, :-1], labels[:, 1:], None
        return logits, labels, None

    def finish_dropout_step(self) -> Dict[str, object]:
        """Scores D and A on held-out samples, rewards the generator, copies the survivor over the other, logs."""
        defender, attacker = bare_module(self.trainer.model), self.attacker
        sides = {
            "defender": (defender, raw_optimizer(self.trainer.optimizer)),
            "attacker": (attacker, self.optimizer),
        }

        def copy_network(source: str, destination: str) -> None:  # weights and optimizer state
            (s_model, s_opt), (d_model, d_opt) = sides[source], sides[destination]
            copy_model_state(s_model, d_model)
            copy_optimizer_state(s_opt, list(s_model.parameters()), d_opt, list(d_model.parameters()))

        stats = end_dropout_step(
            self.game, defender, attacker, self.heldout_batches(), self.trainer._attendout_logits, copy_network
        )
        self.logs.log_dropout_step(self.trainer, stats, self.game.dropout_steps_done)
        return stats
