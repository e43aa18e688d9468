"""What an HF trainer tells its user without a raised log level (issue 40 items 3, 4 and 8): a
regularizer that will not act in the planned run, the sites it regularizes, AttendOut's held-out set
and generator length, and Gemma-2's soft-capping named as the difference."""

import warnings

import pytest
import torch
import transformers
from transformers import TrainerCallback

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.planned_run import IdleRegularizerWarning
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from helpers import pad_collate, small_bert, tiny_llama, token_data, trainer_args


class _WarningsBeforeTheFirstStep(TrainerCallback):
    """The warnings raised before the first training step begins (``record``: warnings.catch_warnings')."""

    def __init__(self, record):
        self.record, self.seen = record, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.seen is None:
            self.seen = [str(w.message) for w in self.record if isinstance(w, warnings.WarningMessage)]


def _train_and_collect(trainer):
    """Trains at the default warning filters and log levels: the warning must pass them as they are."""
    with warnings.catch_warnings(record=True) as record:
        seen = _WarningsBeforeTheFirstStep(record)
        trainer.add_callback(seen)
        trainer.train()
    return [m for m in seen.seen if "will never" in m or "no dropout step will end" in m]


def test_the_warning_is_a_warning_with_its_category_before_the_progress_bar_is_drawn(tmp_path, monkeypatch):
    """Not a bare line printed into the bar: an IdleRegularizerWarning, raised before ProgressCallback
    draws the bar at train begin."""
    trainer = ADDropTrainer(
        model=small_bert(),
        args=trainer_args(tmp_path, num_train_epochs=1, disable_tqdm=False),
        train_dataset=token_data(8, seed=1),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.3, q=0.3),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        draw = transformers.trainer_callback.ProgressCallback.on_train_begin

        def drawn(callback, *args, **kwargs):
            record.append("the bar is drawn")
            return draw(callback, *args, **kwargs)

        monkeypatch.setattr(transformers.trainer_callback.ProgressCallback, "on_train_begin", drawn)
        trainer.train()
    said = [i for i, w in enumerate(record) if not isinstance(w, str) and "will never act" in str(w.message)]
    assert len(said) == 1 and record[said[0]].category is IdleRegularizerWarning
    assert said[0] < record.index("the bar is drawn")


# -- item 3: a regularizer that will not act in the planned run says so before training ----------
@pytest.mark.parametrize(
    "length,rows,plan",
    [
        (dict(num_train_epochs=1), 8, "plans 1 epoch (TrainingArguments.num_train_epochs=1)"),
        (dict(max_steps=1), 16, "plans 1 epoch (TrainingArguments.max_steps=1)"),  # below one epoch of 2 steps
    ],
)
def test_one_planned_epoch_of_cross_tuning_warns_before_training(tmp_path, length, rows, plan):
    trainer = ADDropTrainer(
        model=small_bert(),
        args=trainer_args(tmp_path, **length),
        train_dataset=token_data(rows, seed=1),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.3, q=0.3, layers="all"),
    )
    [message] = _train_and_collect(trainer)
    assert 'ADDropConfig(schedule="cross-tuning") is plain in epoch 1' in message
    assert f"{plan}: AD-DROP will never act" in message
    assert 'Set ADDropConfig(schedule="always")' in message
    assert all(r["ad_drop_on"] == 0 for r in trainer.state.log_history if "ad_drop_on" in r)  # the case is real


@pytest.mark.parametrize("schedule,epochs", [("always", 1), ("cross-tuning", 2)])
def test_a_run_in_which_ad_drop_acts_gets_no_warning(tmp_path, schedule, epochs):
    trainer = ADDropTrainer(
        model=small_bert(),
        args=trainer_args(tmp_path, num_train_epochs=epochs),
        train_dataset=token_data(8, seed=1),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.3, q=0.3, schedule=schedule),
    )
    assert _train_and_collect(trainer) == []
    assert any(r.get("ad_drop_on") == 1 for r in trainer.state.log_history)


def test_attendout_and_scheduled_dropout_that_never_act_warn(tmp_path):
    attendout = AttendOutTrainer(
        model=small_bert(),
        args=trainer_args(tmp_path, max_steps=1),
        train_dataset=token_data(16, seed=1),
        eval_dataset=token_data(4, seed=2),
        data_collator=pad_collate,
        attendout=AttendOutConfig(dropout_step=2),
    )
    [message] = _train_and_collect(attendout)
    assert "every AttendOutConfig(dropout_step=2) updates, and this run plans 1 update" in message
    scheduled = AttnRegTrainer(
        model=small_bert(),
        args=trainer_args(tmp_path, max_steps=1),
        train_dataset=token_data(16, seed=1),
        data_collator=pad_collate,
        scheduled_dropout=ScheduledDropoutConfig(schedule="0:0,10:0.5"),  # 0 at update 0, the only one planned
    )
    [message] = _train_and_collect(scheduled)
    assert 'ScheduledDropoutConfig(schedule="0:0,10:0.5") is 0 at every one of the 1 update' in message


# -- item 8: which sites, in the first training log record -----------------------------------------
def _lm_collate(batch):
    out = pad_collate(batch)
    out["labels"] = out["input_ids"].masked_fill(out["attention_mask"].eq(0), -100)
    return out


@pytest.mark.parametrize("model_kind", ["encoder", "decoder-only"])
def test_the_first_training_log_record_names_the_regularized_sites(tmp_path, model_kind):
    if model_kind == "encoder":
        trainer = ADDropTrainer(
            model=small_bert(),
            args=trainer_args(tmp_path, max_steps=2),
            train_dataset=token_data(16, seed=1),
            data_collator=pad_collate,
            ad_drop=ADDropConfig(layers="1"),
        )
        expected = {"attn_reg_sites_found": 2, "attn_reg_attention": "encoder-self", "attn_reg_sites": 1}
    else:
        trainer = AttnRegTrainer(
            model=tiny_llama(),
            args=trainer_args(tmp_path, max_steps=2),
            train_dataset=token_data(16, seed=1),
            data_collator=_lm_collate,
            layerdrop=AttentionLayerDropConfig(p=0.1),
        )
        expected = {"attn_reg_sites_found": 2, "attn_reg_attention": "decoder-self", "attn_reg_sites": 2}
    trainer.train()
    first, second = [r for r in trainer.state.log_history if "loss" in r]
    assert {k: first[k] for k in expected} == expected
    assert not any(k.startswith("attn_reg_sites") for k in second)  # once, not in every record


# -- item 4: AttendOut's held-out set and the generator's length -------------------------------------
def _attendout(tmp_path, eval_dataset, **kw):
    config = kw.pop("attendout", AttendOutConfig(dropout_step=2))
    model = kw.pop("model", None) or small_bert()
    return AttendOutTrainer(
        model=model,
        args=trainer_args(tmp_path, max_steps=kw.pop("max_steps", 2), per_device_eval_batch_size=4),
        train_dataset=kw.pop("train", None) or token_data(16, seed=1),
        eval_dataset=eval_dataset,
        data_collator=pad_collate,
        attendout=config,
        **kw,
    )


def test_attendout_draws_held_out_samples_from_the_named_set_and_evaluates_every_set(tmp_path):
    heldout = token_data(6, seed=2, min_len=5, max_len=6)
    dev = token_data(6, seed=3, min_len=12, max_len=14)  # told apart by length
    trainer = _attendout(tmp_path, {"heldout": heldout, "dev": dev}, attendout_valid_subset="heldout")
    scored = []
    own = trainer._attendout_logits

    def recording(model, batch):
        scored.extend(batch["attention_mask"].sum(1).tolist())
        return own(model, batch)

    trainer._attendout_logits = recording
    trainer.train()
    assert len(scored) == 2 * 2 and all(n <= 6 for n in scored)  # D and A on T = 2 samples, all held-out ones
    metrics = trainer.evaluate()
    assert "eval_heldout_loss" in metrics and "eval_dev_loss" in metrics


def test_a_single_eval_dataset_is_still_the_held_out_set(tmp_path):
    dev = token_data(6, seed=2)
    assert _attendout(tmp_path, dev).attendout_driver.heldout_dataset is dev


@pytest.mark.parametrize(
    "eval_dataset,subset,message",
    [
        ("dict", None, r"eval_dataset is a dict \('heldout', 'dev'\); name the set .* attendout_valid_subset=<key>"),
        ("dict", "valid", r"attendout_valid_subset='valid' is not a key of eval_dataset \('heldout', 'dev'\)"),
        ("one", "heldout", r"attendout_valid_subset='heldout' names a key of a dict eval_dataset, but eval_dataset"),
    ],
)
def test_a_held_out_set_that_cannot_be_found_is_refused_at_construction(tmp_path, eval_dataset, subset, message):
    data = token_data(4, seed=2)
    given = {"heldout": data, "dev": data} if eval_dataset == "dict" else data
    with pytest.raises(ValueError, match=message):
        _attendout(tmp_path, given, attendout_valid_subset=subset)


def test_the_generator_covers_the_models_length_unless_max_positions_is_set(tmp_path):
    """Before: 1,024 positions whatever the model; a 1,030-token batch stopped at the first step."""
    long_rows = token_data(2, seed=1, min_len=1030, max_len=1030)
    trainer = _attendout(
        tmp_path,
        token_data(2, seed=2, min_len=1030, max_len=1030),
        model=small_bert(max_position_embeddings=1040),
        train=long_rows,
        attendout=AttendOutConfig(dropout_step=1),
        max_steps=1,
    )
    assert trainer.attendout_generator.positions.num_embeddings == 1040
    trainer.train()
    assert any("attendout_win_rate" in r for r in trainer.state.log_history)


def test_an_explicit_max_positions_shorter_than_a_batch_stops_before_any_update(tmp_path):
    trainer = _attendout(tmp_path, token_data(4, seed=2), attendout=AttendOutConfig(dropout_step=2, max_positions=8))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(
        ValueError,
        match=r"AttendOutConfig\.max_positions: a sequence of 10 tokens .* set AttendOutConfig\.max_positions to at least 10",
    ):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# -- item 8: Gemma-2's logit soft-capping is the difference named ------------------------------------
def test_gemma2_with_eager_attention_is_refused_naming_its_soft_capping(tmp_path):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(ValueError) as refused:
        ADDropTrainer(model=model, args=trainer_args(tmp_path, max_steps=1), ad_drop=ADDropConfig())
    message = str(refused.value)
    assert message.startswith("Gemma2ForCausalLM (gemma2): its attention caps the scores")
    assert "attention logit soft-capping, softcap * tanh(scores / softcap) with softcap=50.0" in message
    assert "neither its idle path (transformers' sdpa) nor its regularized kernel applies the cap" in message
    assert "Setting config.attn_logit_softcapping=None is not enough" in message
    assert "probe forward" not in message and "`sdpa` attention does not support" not in message
    assert model.config._attn_implementation == "eager"  # left as it was
