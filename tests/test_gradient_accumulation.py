"""Gradient accumulation: four accumulated micro-batches give the update of one 4x batch.

Dropout is off and each regularizer's random draws are made a deterministic function of the
sample (AD-DROP drops its whole candidate region, the AttendOut Generator drops where its logit
is above a threshold, LayerDrop has p = 1), so the two runs see the same masks and only the loss
normalisation can differ. HF: equal-length sequences, no padding; fairseq masks padding.
"""

import pytest
import torch
import transformers

from attn_reg_plugin.core.kernel import rules
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.attendout import policy as attendout_policy
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from helpers import TINY_TRANSFORMER, fairseq_in_process, tiny_bert_classifier, tiny_llama


@pytest.fixture
def deterministic_masks(monkeypatch):
    # Every AD-DROP candidate dropped (a row still keeps one valid key): the drops then depend on each
    # sample's own attributions only, not on where the sample sits in the batch, which keys the coins.
    monkeypatch.setattr(
        rules.Block,
        "coins",
        lambda block, p: torch.ones(block.shape, dtype=torch.bool, device=block.valid.device),
    )
    monkeypatch.setattr(attendout_policy, "gumbel_drops", lambda logits, uniforms: logits.float() > -1.2)


def _bert():
    return tiny_bert_classifier(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")


def _llama():
    return tiny_llama(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=50,
        attn_implementation="sdpa",
    )


def _rows(n, seed, causal_lm=False):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 50, (7,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone() if causal_lm else torch.tensor(i % 2)})
    return rows


def _collate(rows):
    ids = torch.stack([r["input_ids"] for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.stack([r["labels"] for r in rows]),
    }


def _hf_update(family, regularizer, tmp_path, batch, accumulation):
    causal_lm = family == "llama"
    model = _llama() if causal_lm else _bert()
    kind = "decoder-self" if causal_lm else "encoder-self"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"{batch}x{accumulation}"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        seed=0,
        data_seed=0,
        remove_unused_columns=False,
        per_device_eval_batch_size=4,
    )
    common = dict(model=model, args=args, train_dataset=_rows(8, 1, causal_lm), data_collator=_collate)
    if regularizer == "ad-drop":
        trainer = ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always", attention=kind))
    elif regularizer == "attendout":
        trainer = AttendOutTrainer(**common, eval_dataset=_rows(4, 2), attendout=AttendOutConfig(dropout_step=5))
    elif regularizer == "layerdrop":
        trainer = AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=1.0, layers="0", attention=kind))
    else:
        trainer = transformers.Trainer(**common)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    models = [model] + ([trainer.attendout_attacker] if regularizer == "attendout" else [])
    starts = before * len(models)  # A starts as a copy of D
    return [p.detach() - b for p, b in zip((p for m in models for p in m.parameters()), starts)]


def _ratio(accumulated, big):
    """c with accumulated = c * big, checked to hold for every entry."""
    a, b = torch.cat([x.flatten() for x in accumulated]), torch.cat([x.flatten() for x in big])
    c = float(a @ b / (b @ b))
    # The deltas are p_after - p_before at lr 1: weights near 1.0 keep ~1e-7 of rounding, far
    # below a normalisation error (a factor, such as 4).
    torch.testing.assert_close(a, c * b, rtol=1e-4, atol=1e-3 * float(b.abs().max()))
    return c


@pytest.fixture(scope="module")
def plain_ratio(tmp_path_factory):
    """transformers' own normalisation: 1 for a causal LM (its loss uses num_items_in_batch); for
    BertForSequenceClassification (5.23) the accumulated gradient is 4x the big batch's, because
    the model accepts loss kwargs but its classification loss ignores num_items_in_batch."""

    def measure(family):
        tmp = tmp_path_factory.mktemp(f"plain-{family}")
        return _ratio(_hf_update(family, "plain", tmp, 2, 4), _hf_update(family, "plain", tmp, 8, 1))

    return {family: measure(family) for family in ("bert", "llama")}


HF_CASES = [
    ("bert", "ad-drop"),
    ("bert", "attendout"),
    ("bert", "layerdrop"),
    ("llama", "ad-drop"),
    ("llama", "layerdrop"),
]


@pytest.mark.parametrize("family,regularizer", HF_CASES, ids=[f"{f}-{r}" for f, r in HF_CASES])
def test_hf_accumulation_normalises_like_plain_training(
    deterministic_masks, plain_ratio, tmp_path, family, regularizer
):
    assert plain_ratio["llama"] == pytest.approx(1.0, rel=1e-4)
    big = _hf_update(family, regularizer, tmp_path, batch=8, accumulation=1)
    accumulated = _hf_update(family, regularizer, tmp_path, batch=2, accumulation=4)
    assert _ratio(accumulated, big) == pytest.approx(plain_ratio[family], rel=1e-4)


FAIRSEQ = {
    "ad-drop": [
        "--criterion",
        "ad_drop_label_smoothed_cross_entropy",
        "--ad-drop-schedule",
        "always",
        "--ad-drop-p",
        "0.3",
        "--ad-drop-q",
        "0.5",
    ],
    "layerdrop": [
        "--criterion",
        "label_smoothed_cross_entropy",
        "--attn-layerdrop-p",
        "1",
        "--attn-layerdrop-layers",
        "0",
    ],
    "attendout": ["--criterion", "label_smoothed_cross_entropy", "--attendout", "--attendout-dropout-step", "5"],
}


def _fairseq_gradients(data_bin, regularizer, batches):
    """The gradient fairseq's trainer steps with: summed over the micro-batches / their total sample
    size. ``batches``: lists of train-split indices, one list per micro-batch."""
    from fairseq import optim

    cfg, task, model, criterion, data = fairseq_in_process(
        data_bin,
        [
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            "--dropout",
            "0",
            "--label-smoothing",
            "0.1",
            "--optimizer",
            "sgd",
            "--lr",
            "1",
            *FAIRSEQ[regularizer],
        ],
        seed=3,
    )
    optimizer = optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    model.train()
    total = 0
    if len(batches) == 1:  # the big batch: of several lengths, so it pads (the Generator's positions ignore padding)
        assert len({int(data.src_sizes[i]) for i in batches[0]}) > 1
    for sample in (data.collater([data[i] for i in ids]) for ids in batches):
        _, size, _ = task.train_step(sample, model, criterion, optimizer, update_num=0)
        total += size
    grads = [p.grad / total for p in model.parameters()]
    if regularizer == "attendout":  # A's own normalisation, as it steps in optimizer_step
        attendout = task.attn_reg_attendout
        grads += [p.grad / attendout.sample_size for p in attendout.attacker.parameters()]
    return grads


@pytest.mark.parametrize("regularizer", list(FAIRSEQ))
def test_fairseq_update_freq_equals_one_big_batch(deterministic_masks, tiny_mt_data, regularizer):
    """Four micro-batches of one pair (what --update-freq 4 accumulates) against one batch of the
    four: fairseq's transformer masks padding, so only rounding differs between the batchings."""
    ids = [0, 1, 2, 3]
    big = _fairseq_gradients(tiny_mt_data["bin"], regularizer, [ids])
    micro = _fairseq_gradients(tiny_mt_data["bin"], regularizer, [[i] for i in ids])
    scale = max(float(g.abs().max()) for g in big)
    for a, b in zip(micro, big):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale)
