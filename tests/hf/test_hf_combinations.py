"""The Hugging Face trainers read core.combinations' table when they are built: a combination it lists
trains end to end across cross-tuning's epoch boundary, any other is refused at construction naming
both keywords. Beside it, what this round made each baseline do as its paper says: DropKey in place of
the weights' dropout, R-Drop's warning on a model without dropout, AD-DROP in a user's own loop."""

import warnings

import pytest
import torch
import transformers

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
from attn_reg_plugin.core.regularizers.planned_run import IdleRegularizerWarning
from attn_reg_plugin.core.regularizers.rdrop import RDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import (
    ADDropTrainer,
    ADDropTrainerMixin,
    AttendOutTrainerMixin,
    AttnRegTrainer,
    AttnRegTrainerMixin,
    RDropTrainer,
    RDropTrainerMixin,
)
from helpers import kernel_dropout_at_hooked_calls, pad_collate, small_bert, tiny_llama, token_data, trainer_args


class ADDropRDrop(ADDropTrainerMixin, RDropTrainerMixin, transformers.Trainer):
    """The combination the table lists."""


class ADDropAttnReg(ADDropTrainerMixin, AttnRegTrainerMixin, transformers.Trainer):
    pass


class AttnRegADDrop(AttnRegTrainerMixin, ADDropTrainerMixin, transformers.Trainer):
    pass


class AttendOutAttnReg(AttendOutTrainerMixin, AttnRegTrainerMixin, transformers.Trainer):
    pass


class AttendOutADDrop(AttendOutTrainerMixin, ADDropTrainerMixin, transformers.Trainer):
    pass


AD_DROP = dict(ad_drop=ADDropConfig(p=0.3, q=0.3))
DROPKEY = dict(scheduled_dropout=ScheduledDropoutConfig(schedule="dropkey:0.1"))
DROPHEAD = dict(drophead=DropHeadConfig(schedule="0:0.2"))
ATTENDOUT = dict(attendout=AttendOutConfig(dropout_step=2))


@pytest.mark.parametrize(
    "cls,kwargs,named",
    [
        (ADDropAttnReg, {**AD_DROP, **DROPKEY}, "AD-DROP (ad_drop=ADDropConfig) and DropKey (scheduled_dropout="),
        (AttnRegADDrop, {**AD_DROP, **DROPKEY}, "AD-DROP (ad_drop=ADDropConfig) and DropKey (scheduled_dropout="),
        (
            ADDropAttnReg,
            {**AD_DROP, **DROPHEAD},
            "AD-DROP (ad_drop=ADDropConfig) and DropHead (drophead=DropHeadConfig)",
        ),
        (AttendOutAttnReg, {**ATTENDOUT, **DROPKEY}, "AttendOut (attendout=AttendOutConfig) and DropKey"),
        (AttendOutAttnReg, {**ATTENDOUT, **DROPHEAD}, "AttendOut (attendout=AttendOutConfig) and DropHead"),
        (AttendOutADDrop, {**ATTENDOUT, **AD_DROP}, "AD-DROP (ad_drop=ADDropConfig) and AttendOut"),
    ],
)
def test_a_combination_the_table_does_not_list_is_refused_at_construction_naming_both(tmp_path, cls, kwargs, named):
    with pytest.raises(ValueError) as e:
        cls(model=small_bert(), args=trainer_args(tmp_path), **kwargs)
    assert named in str(e.value) and "do not combine in one run" in str(e.value)
    assert "combinations that exist: AD-DROP + R-Drop" in str(e.value)


def test_two_regularizers_of_attn_reg_trainer_are_refused_by_the_same_table(tmp_path):
    with pytest.raises(ValueError, match=r"DropKey \(scheduled_dropout=.*\) and DropHead \(drophead=DropHeadConfig\)"):
        AttnRegTrainer(model=small_bert(), args=trainer_args(tmp_path), **DROPKEY, **DROPHEAD)


def test_rdrop_over_ad_drop_trains_across_cross_tunings_epoch_boundary(tmp_path):
    """Epoch 1 plain R-Drop, epoch 2 R-Drop over AD-DROP's masked pass; both logged where they acted."""
    trainer = ADDropRDrop(
        model=small_bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
        args=trainer_args(tmp_path, num_train_epochs=2),
        train_dataset=token_data(16, seed=1),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.3, q=0.3),  # cross-tuning, the default
        rdrop=RDropConfig(alpha=1.0),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4  # 2 steps per epoch
    assert [h["ad_drop_on"] for h in logs] == [0, 0, 1, 1]
    assert [h["ad_drop_rate"] > 0 for h in logs] == [False, False, True, True]
    assert all(h["rdrop_kl"] > 0 and torch.isfinite(torch.tensor(h["loss"])) for h in logs)


# -- DropKey takes the place of the model's attention dropout ---------------------------------------
@pytest.mark.parametrize("schedule,reaching", [("dropkey:0.2", 0.0), ("0:0.2", 0.1)])
def test_at_a_dropkey_site_bert_s_attention_dropout_is_off(tmp_path, monkeypatch, schedule, reaching):
    """BERT's attention_probs_dropout_prob=0.1 (its default) reaches the kernel under a knot schedule,
    which adds to it, and not under DropKey, which replaces it."""
    trainer = AttnRegTrainer(
        model=small_bert(attention_probs_dropout_prob=0.1, attn_implementation="sdpa"),
        args=trainer_args(tmp_path, max_steps=1),
        train_dataset=token_data(8, seed=1),
        data_collator=pad_collate,
        scheduled_dropout=ScheduledDropoutConfig(schedule=schedule),
    )
    seen = kernel_dropout_at_hooked_calls(monkeypatch)
    trainer.train()
    assert seen == [reaching, reaching]  # both layers of one step


# -- R-Drop needs the model's dropout -----------------------------------------------------------------
def test_rdrop_on_a_model_without_dropout_warns_at_construction(tmp_path):
    with pytest.warns(IdleRegularizerWarning, match=r"rdrop=RDropConfig: LlamaForCausalLM has no dropout anywhere"):
        RDropTrainer(model=tiny_llama(), args=trainer_args(tmp_path), rdrop=RDropConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdleRegularizerWarning)
        RDropTrainer(model=tiny_llama(attention_dropout=0.1), args=trainer_args(tmp_path), rdrop=RDropConfig())
        RDropTrainer(model=small_bert(), args=trainer_args(tmp_path), rdrop=RDropConfig())


def test_the_dropout_search_sees_functional_dropouts_layerdrop_and_drop_paths():
    class Functional(torch.nn.Module):  # F.dropout(h, self.p_drop, self.training), a drop path, a LayerDrop
        def __init__(self, **probabilities):
            super().__init__()
            self.__dict__.update(probabilities)

    class DropPath(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

    from attn_reg_plugin.core.regularizers.rdrop import model_dropout

    assert model_dropout(Functional(p_drop=0.3)) == {"p_drop": 0.3}
    assert model_dropout(Functional(drop_prob=0.2, layerdrop=0.0)) == {"drop_prob": 0.2}
    assert list(model_dropout(torch.nn.Sequential(DropPath(0.1), torch.nn.Linear(2, 2)))) == ["0"]
    assert model_dropout(Functional(p_drop=0.0, rate=0.5)) == {}  # a name that says no drop is not read
    from helpers import tiny_marian

    quiet = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    assert model_dropout(tiny_marian(**quiet)) == {}
    assert set(model_dropout(tiny_marian(**quiet, encoder_layerdrop=0.3))) >= {"model.encoder.layerdrop"}


# -- AD-DROP in a user's own loop ----------------------------------------------------------------------
def _own_loop_steps(trainer, epochs):
    model, batch = trainer.model, pad_collate(token_data(8, seed=3))
    model.train()
    for epoch in epochs:
        if epoch is not None:
            trainer.set_ad_drop_epoch(epoch)
        trainer.compute_loss(model, dict(batch)).backward()
    return trainer._ad_drop_on_steps


def test_an_own_loop_under_cross_tuning_warns_once_and_says_how_to_name_the_epoch(tmp_path):
    trainer = ADDropTrainer(model=small_bert(), args=trainer_args(tmp_path), **AD_DROP)
    with pytest.warns(IdleRegularizerWarning) as record:
        assert _own_loop_steps(trainer, [None, None]) == 0  # every step in epoch 1: plain
    [message] = [str(w.message) for w in record if w.category is IdleRegularizerWarning]
    assert "trainer.set_ad_drop_epoch(epoch)" in message and 'ADDropConfig(schedule="always")' in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdleRegularizerWarning)
        told = ADDropTrainer(model=small_bert(), args=trainer_args(tmp_path), **AD_DROP)
        assert _own_loop_steps(told, [1, 2, 3, 4]) == 2  # the even epochs
        always = ADDropTrainer(model=small_bert(), args=trainer_args(tmp_path), ad_drop=ADDropConfig(schedule="always"))
        assert _own_loop_steps(always, [None, None]) == 2
    with pytest.raises(ValueError, match=r"set_ad_drop_epoch: epoch must be an integer >= 1 \(1-based\), got 0"):
        told.set_ad_drop_epoch(0)
