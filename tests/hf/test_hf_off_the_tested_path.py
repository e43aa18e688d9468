"""One step off the tested path (issue: trust): a second trainer on one model, resuming from a
``Path``, a family outside the table, multi-label gold labels, an IterableDataset, a batch with no
target token, every head class of every supported family. Each test fails on the code before its fix."""

import logging
from pathlib import Path

import pytest
import torch
import transformers
from families import FAMILIES, build

from attn_reg_plugin.core.kernel import blockwise
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.attribution import multi_label_target, token_loss_target
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer, install_attention_sites
from helpers import pad_collate, small_bert, token_data, trainer_args


def _args(tmp_path, **kw):
    return trainer_args(tmp_path, **{"max_steps": 3, **kw})


def _logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# -- 1. a second trainer on the same model ---------------------------------------------------------
def _stock_losses(tmp_path):
    trainer = transformers.Trainer(
        model=small_bert(), args=_args(tmp_path / "stock"), train_dataset=token_data(24, 1), data_collator=pad_collate
    )
    trainer.train()
    return _logs(trainer, "loss")


@pytest.mark.parametrize("first", ["ad_drop", "scheduled_dropout", "layerdrop"])
def test_an_earlier_trainer_still_regularizes_after_a_second_is_built_on_its_model(tmp_path, first):
    """The second trainer's install takes the modules' sites; the first claims its own back at its
    steps, so it trains exactly as it would alone (before: AD-DROP crashed at its first masked step,
    scheduled dropout trained the stock losses, LayerDrop logged a rate it never applied)."""
    kwargs = {
        "ad_drop": dict(ad_drop=ADDropConfig(p=0.5, q=0.5, schedule="always")),
        "scheduled_dropout": dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.5")),
        "layerdrop": dict(layerdrop=AttentionLayerDropConfig(p=0.5)),
    }[first]
    cls = ADDropTrainer if first == "ad_drop" else AttnRegTrainer
    rate = {
        "ad_drop": "ad_drop_rate",
        "scheduled_dropout": "attn_sched_dropout_rate",
        "layerdrop": "attn_layerdrop_rate",
    }[first]

    def run(shared):
        model = small_bert()
        trainer = cls(
            model=model,
            args=_args(tmp_path / str(shared)),
            train_dataset=token_data(24, 1),
            data_collator=pad_collate,
            **kwargs,
        )
        if shared:
            AttnRegTrainer(
                model=model,
                args=_args(tmp_path / "second"),
                train_dataset=token_data(24, 1),
                data_collator=pad_collate,
                layerdrop=AttentionLayerDropConfig(p=1.0),
            )
        trainer.train()
        return _logs(trainer, "loss"), _logs(trainer, rate)

    alone = run(shared=False)
    assert run(shared=True) == alone
    assert all(r > 0 for r in alone[1]) and alone[0] != _stock_losses(tmp_path), alone


@pytest.mark.parametrize("regularizer", ["scheduled_dropout", "layerdrop"])
def test_a_regularizer_that_cannot_act_logs_zero_and_warns(tmp_path, regularizer, caplog):
    """Rates are counted by the kernel from what it applied: with the model switched back to stock sdpa
    after construction nothing reaches the kernel, and the log says 0 (before: LayerDrop logged 1.0)."""
    model = small_bert()
    config = {
        "scheduled_dropout": dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.5")),
        "layerdrop": dict(layerdrop=AttentionLayerDropConfig(p=1.0)),
    }[regularizer]
    trainer = AttnRegTrainer(
        model=model, args=_args(tmp_path), train_dataset=token_data(24, 1), data_collator=pad_collate, **config
    )
    model.config._attn_implementation = "sdpa"  # the attention bypasses the plugin from here on
    with caplog.at_level(logging.WARNING, logger="attn_reg_plugin.hf.attn_reg_trainer"):
        trainer.train()
    key = {"scheduled_dropout": "attn_sched_dropout_rate", "layerdrop": "attn_layerdrop_rate"}[regularizer]
    assert _logs(trainer, key) == [0.0, 0.0, 0.0]
    assert "the attention kernel applied none" in caplog.text


# -- 2. resume from any os.PathLike ---------------------------------------------------------------
def test_attendout_resumes_its_game_from_a_pathlib_path(tmp_path):
    def trainer(folder, **kw):
        return AttendOutTrainer(
            model=small_bert(),
            args=_args(folder, max_steps=8, **kw),
            train_dataset=token_data(48, 1),
            eval_dataset=token_data(12, 2),
            data_collator=pad_collate,
            attendout=AttendOutConfig(dropout_step=3),
        )

    full = trainer(tmp_path / "full", save_strategy="steps", save_steps=4)
    full.train()
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=Path(tmp_path / "full" / "out" / "checkpoint-4"))

    def after(t, key):
        return [(h["step"], h[key]) for h in t.state.log_history if key in h and h["step"] > 4]

    for key in ("loss", "attendout_attacker_loss", "attendout_win_rate", "attendout_baseline"):
        assert after(resumed, key) == after(full, key), key
    assert all(
        torch.equal(a, b)
        for a, b in zip(resumed.attendout_generator.parameters(), full.attendout_generator.parameters())
    )


# -- 3. a model whose attention the plugin does not reproduce ---------------------------------------
def _skewed_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out * 1.1, weights  # a term transformers' sdpa does not compute


def _tiny_llama(implementation):
    family = next(f for f in FAMILIES if f.name == "Llama")
    config = transformers.AutoConfig.for_model(family.model_type, **family.config)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation)


def test_a_model_whose_forward_the_plugin_would_change_is_refused_and_left_as_it_was(tmp_path):
    transformers.AttentionInterface.register("skewed_for_test", _skewed_attention)
    model = _tiny_llama("skewed_for_test")
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM \(llama\): routing attention through attn_reg_plugin "
        r"changes this model's forward \(max \|difference\| .* at model\.layers\.0\.self_attn",
    ):
        ADDropTrainer(
            model=model,
            args=_args(tmp_path),
            train_dataset=token_data(8, 1),
            ad_drop=ADDropConfig(attention="decoder-self"),
        )
    assert model.config._attn_implementation == "skewed_for_test"
    assert not any("attn_reg_sites" in vars(m) for m in model.modules())
    assert torch.equal(model(ids).logits, before)


def test_eager_causal_lm_is_refused_for_its_keyless_rows_and_accepted_as_sdpa():
    """Eager spreads a left-padded row with no valid key over the masked keys, the kernel gives it 0:
    an eager causal LM is refused (tests/hf/test_keyless_rows.py has the detail); as sdpa it installs."""
    with pytest.raises(ValueError, match="no valid key"):
        install_attention_sites(_tiny_llama("eager"), RegularizationController())
    controller = RegularizationController()
    install_attention_sites(_tiny_llama("sdpa"), controller)
    assert [s.kind for s in controller.sites] == ["decoder-self", "decoder-self"]


# -- 4. multi-label classification ------------------------------------------------------------------
def _multi_label_rows(n):
    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 100, (5 + i % 4,), generator=g)
        rows.append({"input_ids": ids, "labels": torch.tensor([float(ids[0] > 50), float(ids[1] > 50), float(i % 2)])})
    return rows


@pytest.mark.parametrize("labels", ["gold", "pseudo"])
def test_multi_label_classification_trains_with_ad_drop(tmp_path, labels):
    """A multi-label classifier (a float label per class) trains with AD-DROP on gold and on pseudo
    labels, with drops at every step and none skipped."""
    model = small_bert(num_labels=3, problem_type="multi_label_classification")
    trainer = ADDropTrainer(
        model=model,
        args=_args(tmp_path, max_steps=2),
        train_dataset=_multi_label_rows(16),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.5, q=0.5, schedule="always", labels=labels),
    )
    trainer.train()
    assert all(r > 0.1 for r in _logs(trainer, "ad_drop_rate")) and _logs(trainer, "ad_drop_skipped") == [0, 0]


def test_multi_label_target_is_minus_the_binary_cross_entropy():
    logits = torch.tensor([[2.0, -1.0, 0.5], [-0.3, 0.2, -4.0]], requires_grad=True)
    gold = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    value, used = multi_label_target(logits, gold)
    torch.testing.assert_close(
        value, -torch.nn.functional.binary_cross_entropy_with_logits(logits, gold, reduction="sum")
    )
    # Pseudo labels: sigmoid > 0.5. A sample with no positive label still has a target (a gradient).
    _, pseudo = multi_label_target(logits)
    assert torch.equal(pseudo, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    (grad,) = torch.autograd.grad(value, logits)
    assert grad[1].abs().sum() > 0


# -- 5. an IterableDataset with max_steps -------------------------------------------------------------
class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_cross_tuning_phase_follows_the_pass_of_an_iterable_dataset(tmp_path):
    """2 batches per pass, 6 steps: plain, AD-DROP, plain passes (before: the first step of each new
    pass ran the previous pass's phase: [0, 0, 0, 1, 1, 0])."""
    trainer = ADDropTrainer(
        model=small_bert(),
        args=_args(tmp_path, max_steps=6, per_device_train_batch_size=4),
        train_dataset=_Stream(token_data(8, 1)),
        data_collator=pad_collate,
        ad_drop=ADDropConfig(p=0.5, q=0.5),
    )
    trainer.train()
    assert _logs(trainer, "ad_drop_on") == [0, 0, 1, 1, 0, 0]


# -- 6. a batch whose target has no token ---------------------------------------------------------
def test_samples_without_a_target_token_are_not_masked():
    """A causal-LM sample whose labels are all -100 has no attribution target: no drop in it, and a
    batch of such samples is a skipped step (before: masks from all-zero attributions, topk's tie order)."""
    model = build(next(f for f in FAMILIES if f.name == "Llama"))
    controller = RegularizationController()
    install_attention_sites(model, controller)
    model.eval()
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    for keep, skipped in ((torch.tensor([[False] * 7, [True] * 7]), 0), (torch.zeros(2, 7, dtype=torch.bool), 1)):
        ad = ADDrop(ADDropConfig(p=0.5, q=0.9, attention="decoder-self", schedule="always"), controller)
        target = lambda out, labels, keep=keep: token_loss_target(out.logits[:, :-1], keep, labels)  # noqa: E731
        drops, rule_drops = [], blockwise.rule_drops  # each call's drops, as the kernel makes them
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(blockwise, "rule_drops", lambda *args: drops.append(rule_drops(*args)) or drops[-1])
            with ad.masked(lambda: model(ids), target, frozen=model) as stats:
                model(ids)
        assert len(drops) == len(controller.sites)
        assert all(not d[0][0].any() for d in drops)  # sample 0: no target, no drop
        assert all(bool(d[0][1].any()) != bool(skipped) for d in drops)
        assert int(stats["skipped"]) == skipped


# -- 8. every head class of every supported family ---------------------------------------------------
def _head_classes(model_type):
    from transformers.models.auto import modeling_auto

    names = set()
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict) and isinstance(mapping.get(model_type), str):
            names.add(mapping[model_type])
    return sorted(names)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sites_are_found_for_every_head_class(family):
    """Every AutoModelFor* class of the family installs (with the equivalence check) and has the base
    model's sites, or a subset for encoder-only / decoder-only heads (before: MultipleChoice and
    encoder-decoder SequenceClassification heads failed in the probe)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    def config():  # fresh for each class: encoder-only heads edit the config they are given
        return transformers.AutoConfig.for_model(family.model_type, **family.config)

    def counts(cls_name):
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(config())
        controller = RegularizationController()
        install_attention_sites(model, controller)
        out = {}
        for s in controller.sites:
            out[s.kind] = out.get(s.kind, 0) + 1
        return out

    base = counts(MODEL_MAPPING_NAMES[family.model_type])
    assert set(base) == set(family.kinds)
    heads = [
        c
        for c in _head_classes(family.model_type)
        if getattr(transformers, c, None) is not None
        and getattr(getattr(transformers, c), "config_class", None) is type(config())
    ]
    assert len(heads) >= 2
    for head in heads:
        got = counts(head)
        assert got and all(got[k] == base[k] for k in got), (head, got, base)
