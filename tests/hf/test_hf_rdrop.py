"""R-Drop through the Hugging Face trainers (RDropTrainer, RDropSeq2SeqTrainer): the Trainer's own loss
of two passes plus alpha times the symmetric KL, for a classifier, a seq2seq model (labels -100
ignored) and a causal LM (shifted); the caller's batch untouched; gradient checkpointing; the logs;
the refusals. DDP on 2 gloo ranks: tests/rdrop_rank.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

import helpers
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.rdrop import RDropConfig
from attn_reg_plugin.hf import (
    ADDropTrainerMixin,
    AttendOutTrainerMixin,
    RDropSeq2SeqTrainer,
    RDropTrainer,
    RDropTrainerMixin,
)
from helpers import classifier_rows, hf_tensorboard_matches_the_log, tiny_bert_classifier, torchrun_ranks

DROPOUT = 0.1
ALPHA = 2.0


def tiny_bert(dropout=DROPOUT, **kw):
    return tiny_bert_classifier(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation="sdpa",
        **kw,
    )


def bert_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}


def marian_batch():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(3, 100, (3, 6), generator=g)
    labels[2, 3:] = -100
    return {"input_ids": torch.randint(3, 100, (3, 8), generator=g), "labels": labels}


def llama_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (3, 8), generator=g)
    return {"input_ids": ids, "labels": ids.masked_fill(torch.arange(8) >= 6, -100)}


FAMILIES = {
    "bert": (tiny_bert, bert_batch, False),
    "marian": (lambda: helpers.tiny_marian(dropout=DROPOUT, attn_implementation="sdpa"), marian_batch, True),
    "llama": (lambda: helpers.tiny_llama(attention_dropout=DROPOUT, attn_implementation="sdpa"), llama_batch, False),
}


def _args(tmp_path, seq2seq=False, **kw):
    cls = transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments
    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no")
    return cls(**{**base, "remove_unused_columns": False, **kw})


def make_trainer(family, tmp_path, model=None, **rdrop):
    build, _, seq2seq = FAMILIES[family]
    cls = RDropSeq2SeqTrainer if seq2seq else RDropTrainer
    return cls(model=model or build(), args=_args(tmp_path, seq2seq), rdrop=RDropConfig(**{"alpha": ALPHA, **rdrop}))


def one_step(trainer, batch, seed=5, **kwargs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); one step is taken here by hand
    torch.manual_seed(seed)
    loss = trainer.training_step(trainer.model, batch, **kwargs)
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def explicit_loss(family, model, batch, concat, seed=5):
    """loss(pass 1) + loss(pass 2) + alpha * mean over the CE's positions of (KL(p1||p2) + KL(p2||p1)) / 2,
    written with F.kl_div, the passes drawn as the trainer draws them."""
    model.train()
    torch.manual_seed(seed)
    if concat:
        out = model(**{k: torch.cat([v, v]) for k, v in batch.items()})
        (l1, l2), ce = out.logits.chunk(2), 2 * out.loss
    else:
        out_1, out_2 = model(**batch), model(**batch)
        (l1, l2), ce = (out_1.logits, out_2.logits), out_1.loss + out_2.loss
    labels = batch["labels"]
    if family == "llama":
        l1, l2, labels = l1[:, :-1], l2[:, :-1], labels[:, 1:]
    keep = torch.ones(l1.shape[:-1], dtype=torch.bool) if family == "bert" else labels.ne(-100)
    lp1, lp2 = l1.log_softmax(-1)[keep], l2.log_softmax(-1)[keep]
    kl = (F.kl_div(lp1, lp2.exp(), reduction="sum") + F.kl_div(lp2, lp1.exp(), reduction="sum")) / 2
    return ce + ALPHA * kl / keep.sum(), kl


@pytest.mark.parametrize("concat", [False, True], ids=["two-forwards", "concat-batch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_both_passes_loss_plus_alpha_times_the_mean_symmetric_kl(family, concat, tmp_path):
    trainer = make_trainer(family, tmp_path, concat_batch=concat)
    batch = FAMILIES[family][1]()
    loss, _ = one_step(trainer, batch)
    with torch.no_grad():
        expected, kl = explicit_loss(family, trainer.model, batch, concat)
    assert kl > 0
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_kl_is_normalized_as_the_models_loss_over_the_accumulated_batch(tmp_path):
    """A causal LM takes num_items_in_batch: its loss is the summed CE over them, and so is the KL."""
    trainer = RDropTrainer(
        model=FAMILIES["llama"][0](),
        args=_args(tmp_path, gradient_accumulation_steps=4),
        rdrop=RDropConfig(alpha=ALPHA),
    )
    assert trainer.model_accepts_loss_kwargs
    batch = llama_batch()
    items = 4 * int(batch["labels"][:, 1:].ne(-100).sum())  # as if 4 micro-batches made the update
    loss, _ = one_step(trainer, batch, num_items_in_batch=torch.tensor(items))
    trainer.model.train()
    torch.manual_seed(5)
    with torch.no_grad():
        ce = sum(trainer.model(**batch, num_items_in_batch=torch.tensor(items)).loss for _ in range(2))
        _, kl = explicit_loss("llama", trainer.model, batch, concat=False)
    torch.testing.assert_close(loss, ce + ALPHA * kl / items, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("concat", [False, True], ids=["two-forwards", "concat-batch"])
def test_kl_is_normalized_as_a_bert_classifiers_loss_which_ignores_the_accumulated_batch(concat, tmp_path):
    """BERT's classifier takes loss keywords but returns its plain mean over the micro-batch: the KL is
    divided by the micro-batch's samples too, so alpha keeps its weight under gradient accumulation."""
    model = tiny_bert(dropout=0.5)
    with torch.no_grad():
        model.classifier.weight.mul_(100.0)  # logits far enough apart that the passes' KL is well above rounding
    args = _args(tmp_path, gradient_accumulation_steps=4)
    trainer = RDropTrainer(model=model, args=args, rdrop=RDropConfig(alpha=ALPHA, concat_batch=concat))
    assert trainer.model_accepts_loss_kwargs
    batch = bert_batch()
    loss, _ = one_step(trainer, batch, num_items_in_batch=torch.tensor(4 * 3))  # 4 micro-batches of 3
    with torch.no_grad():
        expected, kl = explicit_loss("bert", trainer.model, batch, concat)
    assert kl > 1e-3  # large enough that dividing it by the 12 items instead of the 3 samples shows
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_under_label_smoothing_the_kl_is_divided_as_the_smoothers_loss(tmp_path):
    """The Trainer's label smoother divides by num_items_in_batch even for BERT: so does the KL, also
    for a confident model, whose smoothed loss is far from its plain CE (read with the same smoothing)."""
    from transformers.trainer_pt_utils import LabelSmoother

    model = tiny_bert(dropout=0.1)
    with torch.no_grad():
        model.classifier.weight.mul_(3000.0)
    args = _args(tmp_path, gradient_accumulation_steps=4, label_smoothing_factor=0.1)
    trainer = RDropTrainer(model=model, args=args, rdrop=RDropConfig(alpha=ALPHA))
    batch, items = bert_batch(), torch.tensor(4 * 3)
    model.eval()
    with torch.no_grad():  # labels the model is sure of: its CE near 0, its smoothed loss not
        batch["labels"] = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.argmax(-1)
    loss, _ = one_step(trainer, batch, num_items_in_batch=items)
    smoother = LabelSmoother(epsilon=0.1)
    model.train()
    torch.manual_seed(5)
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out_1, out_2 = model(**inputs), model(**inputs)
        ce = sum(smoother(out, batch["labels"], num_items_in_batch=items) for out in (out_1, out_2))
        lp1, lp2 = out_1.logits.log_softmax(-1), out_2.logits.log_softmax(-1)
        kl = (F.kl_div(lp1, lp2.exp(), reduction="sum") + F.kl_div(lp2, lp1.exp(), reduction="sum")) / 2
    assert kl > 1e-3
    torch.testing.assert_close(loss, ce + ALPHA * kl / items, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "others, decided", [([0, 1], False), ([0, 0], None), ([1, 1], True)], ids=["follows", "undecided", "tie-by-items"]
)
def test_the_processes_decide_the_divisor_together(others, decided, tmp_path, monkeypatch):
    """Each process votes [by items, by its batch] from its own batch and the sum over the processes
    decides, at the same step everywhere. Here this process cannot tell (num_items_in_batch equals its
    3 samples) and another votes as ``others``; a tie goes to items, as transformers assumes."""
    reads = []

    def with_another_process(votes):
        reads.append(votes.tolist())
        return votes.add_(torch.tensor(others))

    monkeypatch.setattr("attn_reg_plugin.hf.own_passes_trainer.all_reduce_sum_", with_another_process)
    args = _args(tmp_path, gradient_accumulation_steps=4)
    trainer = RDropTrainer(model=tiny_bert(dropout=0.5), args=args, rdrop=RDropConfig(alpha=ALPHA))
    one_step(trainer, bert_batch(), num_items_in_batch=torch.tensor(3))
    assert reads == [[0, 0]] and getattr(trainer, "_loss_divides_by_items", None) is decided
    one_step(trainer, bert_batch(), num_items_in_batch=torch.tensor(12))  # this process now reads "by batch"
    assert len(reads) == (1 if decided is not None else 2)
    if decided is None:
        assert reads[1] == [0, 1] and trainer._loss_divides_by_items is False


def test_one_micro_batch_counted_on_each_process_reads_nothing(tmp_path, monkeypatch):
    """With one micro-batch per update and num_items_in_batch counted on each process alone
    (average_tokens_across_devices=False), both counts are this batch's: no collective, no host read."""
    reads = []
    monkeypatch.setattr(
        "attn_reg_plugin.hf.own_passes_trainer.all_reduce_sum_", lambda votes: reads.append(votes) or votes
    )
    args = _args(tmp_path, average_tokens_across_devices=False)
    trainer = RDropTrainer(model=tiny_bert(), args=args, rdrop=RDropConfig(alpha=ALPHA))
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))  # as on one of two processes
    one_step(trainer, bert_batch(), num_items_in_batch=torch.tensor(3))
    assert reads == [] and getattr(trainer, "_loss_divides_by_items", None) is None
    monkeypatch.setattr(trainer.model, "_tp_size", 2, raising=False)  # two ranks share each batch
    one_step(trainer, bert_batch(), num_items_in_batch=torch.tensor(1.5))  # transformers' count / tensor ranks
    assert len(reads) == 1 and trainer._loss_divides_by_items is False  # BERT's loss: the batch mean


@pytest.mark.parametrize("concat", [False, True], ids=["two-forwards", "concat-batch"])
def test_the_callers_batch_is_unchanged(concat, tmp_path):
    """Also with label smoothing, where the Trainer's compute_loss pops `labels` from the dict it gets."""
    model = tiny_bert()
    args = _args(tmp_path, label_smoothing_factor=0.1)
    trainer = RDropTrainer(model=model, args=args, rdrop=RDropConfig(alpha=ALPHA, concat_batch=concat))
    batch = bert_batch()
    before, tensors = copy.deepcopy(batch), dict(batch)
    loss, _ = one_step(trainer, batch)
    assert batch.keys() == before.keys()
    for k, v in batch.items():
        assert v is tensors[k] and torch.equal(v, before[k]), k
    # both passes had their labels: twice the smoothed loss of one pass, plus the KL
    assert loss > 0 and trainer.own_pass_sums["rdrop_tokens"] == 3


def test_without_dropout_the_kl_is_zero_and_the_loss_twice_the_plain_loss(tmp_path):
    trainer = RDropTrainer(model=tiny_bert(dropout=0.0), args=_args(tmp_path), rdrop=RDropConfig(alpha=ALPHA))
    batch = bert_batch()
    loss, _ = one_step(trainer, batch)
    assert float(trainer.own_pass_sums["rdrop_kl_sum"]) == 0
    with torch.no_grad():
        plain = trainer.model(**batch).loss
    torch.testing.assert_close(loss, 2 * plain)


def test_same_seed_same_step(tmp_path):
    steps = [one_step(make_trainer("bert", tmp_path), bert_batch(), seed=3) for _ in range(2)]
    assert torch.equal(steps[0][0], steps[1][0])
    assert all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1]))
    assert not torch.equal(steps[0][0], one_step(make_trainer("bert", tmp_path), bert_batch(), seed=4)[0])


@pytest.mark.parametrize("concat", [False, True], ids=["two-forwards", "concat-batch"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(concat, tmp_path):
    loss, grads = one_step(make_trainer("bert", tmp_path, concat_batch=concat), bert_batch())
    for reentrant in (True, False):
        model = tiny_bert()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        loss_ck, grads_ck = one_step(make_trainer("bert", tmp_path, model=model, concat_batch=concat), bert_batch())
        torch.testing.assert_close(loss_ck, loss, rtol=1e-5, atol=0)
        assert len(grads_ck) == len(grads)
        for a, b in zip(grads_ck, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["rdrop", "hiddencut"])
def test_a_compiled_causal_lm_compares_the_shifted_positions_as_eager(method, tmp_path):
    """torch_compile=True hands the loss the compile wrapper (accelerate's unwrap_model keeps it): the
    consistency term is still taken at the shifted positions, as the CE is, so the trained weights
    are eager's. Before, the wrapper's class read as no causal LM: logits at t were compared for label t."""
    from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig
    from attn_reg_plugin.hf import HiddenCutTrainer

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):  # right-padded rows of 6 to 9 real tokens
        ids = torch.zeros(10, dtype=torch.long)
        ids[: 6 + i] = torch.randint(3, 100, (6 + i,), generator=g)
        mask = (ids != 0).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    weights = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = helpers.tiny_llama(attention_dropout=0.1, attn_implementation="sdpa")
        extra = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
        args = helpers.trainer_args(tmp_path / str(compiled), per_device_train_batch_size=4, max_steps=1, **extra)
        if method == "rdrop":
            trainer = RDropTrainer(model=model, args=args, train_dataset=rows, rdrop=RDropConfig(alpha=1.0))
        else:
            trainer = HiddenCutTrainer(model=model, args=args, train_dataset=rows, hiddencut=HiddenCutConfig())
        trainer.train()
        weights.append([p.detach().clone() for p in model.parameters()])
    for eager, compiled in zip(*weights):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_training_logs_rdrop_kl_and_evaluation_is_one_pass(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=4, logging_steps=2, max_steps=4, learning_rate=1e-3)
    args.report_to = ["tensorboard"]
    trainer = RDropTrainer(
        model=tiny_bert(), args=args, train_dataset=classifier_rows(16, 0), eval_dataset=classifier_rows(4, 1),
        data_collator=torch.utils.data.default_collate, rdrop=RDropConfig(alpha=ALPHA),
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["rdrop_kl"] > 0 for h in logs)
    hf_tensorboard_matches_the_log(trainer, ["rdrop_kl"])
    calls = []
    trainer.model.register_forward_hook(lambda *a: calls.append(1))
    metrics = trainer.evaluate()
    assert len(calls) == 1 and "eval_rdrop_kl" not in metrics


def test_refusals(tmp_path):
    with pytest.raises(TypeError, match=r"^rdrop must be an RDropConfig, got dict$"):
        RDropTrainer(model=tiny_bert(), args=_args(tmp_path), rdrop={"alpha": 1.0})
    with pytest.raises(ValueError, match=r"^RDropConfig.alpha must be a finite number >= 0, got -1$"):
        RDropTrainer(model=tiny_bert(), args=_args(tmp_path), rdrop=RDropConfig(alpha=-1))

    class RDropOutside(RDropTrainerMixin, ADDropTrainerMixin, transformers.Trainer):
        pass

    with pytest.raises(ValueError, match=r"^R-Drop over AD-DROP needs ADDropTrainerMixin before RDropTrainerMixin"):
        RDropOutside(model=tiny_bert(), args=_args(tmp_path), rdrop=RDropConfig(), ad_drop=ADDropConfig())

    class WithAttendOut(RDropTrainerMixin, AttendOutTrainerMixin, transformers.Trainer):
        pass

    with pytest.raises(ValueError) as e:
        WithAttendOut(model=tiny_bert(), args=_args(tmp_path), rdrop=RDropConfig(), attendout=AttendOutConfig())
    assert str(e.value).startswith(
        "AttendOut (attendout=AttendOutConfig) and R-Drop (rdrop=RDropConfig) do not combine"
    )
    with pytest.raises(ValueError, match=r"^R-Drop over AD-DROP does not take rdrop=RDropConfig\(concat_batch=True\)"):
        ADDropRDrop(
            model=tiny_bert(), args=_args(tmp_path), rdrop=RDropConfig(concat_batch=True), ad_drop=ADDropConfig()
        )


class ADDropRDrop(ADDropTrainerMixin, RDropTrainerMixin, transformers.Trainer):
    """R-Drop as AD-DROP's masked pass, the combination allowed."""


def test_rdrop_over_ad_drop_takes_the_steps_drops_in_both_passes(tmp_path):
    """Without model dropout the two passes differ only if their AD-DROP drops do: they do not (no
    KL), and the loss is twice ADDropTrainer's from the same seed, drop for drop."""
    from attn_reg_plugin.hf import ADDropTrainer

    ad_drop = ADDropConfig(p=0.5, q=0.5, schedule="always")
    both = ADDropRDrop(
        model=tiny_bert(dropout=0.0), args=_args(tmp_path), rdrop=RDropConfig(alpha=ALPHA), ad_drop=ad_drop
    )
    alone = ADDropTrainer(model=tiny_bert(dropout=0.0), args=_args(tmp_path), ad_drop=ad_drop)
    alone.model.load_state_dict(both.model.state_dict())
    loss, _ = one_step(both, bert_batch())
    alone_loss, _ = one_step(alone, bert_batch())
    assert float(both.own_pass_sums["rdrop_kl_sum"]) == 0 and int(both.own_pass_sums["rdrop_tokens"]) == 3
    assert int(alone._ad_drop_dropped) > 0 and int(both._ad_drop_dropped) == 2 * int(alone._ad_drop_dropped)
    torch.testing.assert_close(loss, 2 * alone_loss)
    noisy = ADDropRDrop(model=tiny_bert(dropout=0.3), args=_args(tmp_path), rdrop=RDropConfig(), ad_drop=ad_drop)
    checkpointed = ADDropRDrop(
        model=copy.deepcopy(noisy.model), args=_args(tmp_path, gradient_checkpointing=True), rdrop=RDropConfig(),
        ad_drop=ad_drop,
    )  # fmt: skip
    checkpointed.model.gradient_checkpointing_enable()
    noisy_loss, grads = one_step(noisy, bert_batch())
    assert float(noisy.own_pass_sums["rdrop_kl_sum"]) > 0 and int(noisy._ad_drop_dropped) > 0
    checkpointed_loss, checkpointed_grads = one_step(checkpointed, bert_batch())  # both passes recomputed
    assert torch.equal(checkpointed_loss, noisy_loss)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, checkpointed_grads))


def _attention_dropout_only(family):
    """A tiny classifier whose one dropout is the attention's (0.3); ALBERT calls its one attention
    module at every depth (one site per depth)."""
    if family == "bert":
        return tiny_bert_classifier(
            hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.3, attn_implementation="sdpa", initializer_range=0.5,
        )  # fmt: skip
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100,
        embedding_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.3, classifier_dropout_prob=0.0,
        num_labels=2, attn_implementation="sdpa", initializer_range=0.5,
    )  # fmt: skip
    return transformers.AlbertForSequenceClassification(config)


@pytest.mark.parametrize("family", ["bert", "albert"])
def test_rdrop_over_ad_drop_draws_each_forwards_own_attention_dropout(family, tmp_path):
    """With attention dropout the only dropout (a hidden dropout would hide the attention's), the masked
    pass's two forwards drop other attention weights, so R-Drop's KL is positive, as plain R-Drop's is,
    while their AD-DROP drops are the step's (as many dropped in each forward)."""
    ad_drop = ADDropConfig(p=0.5, q=0.5, schedule="always")
    model = _attention_dropout_only(family)
    plain = RDropTrainer(model=copy.deepcopy(model), args=_args(tmp_path), rdrop=RDropConfig(alpha=ALPHA))
    both = ADDropRDrop(model=model, args=_args(tmp_path), rdrop=RDropConfig(alpha=ALPHA), ad_drop=ad_drop)
    one_step(plain, bert_batch())
    one_step(both, bert_batch())
    assert float(plain.own_pass_sums["rdrop_kl_sum"]) > 0
    assert float(both.own_pass_sums["rdrop_kl_sum"]) > 0.1 * float(plain.own_pass_sums["rdrop_kl_sum"])
    assert int(both._ad_drop_dropped) > 0 and int(both._ad_drop_dropped) % 2 == 0


def test_a_regression_head_is_refused_at_the_first_step(tmp_path):
    trainer = RDropTrainer(model=tiny_bert(num_labels=1), args=_args(tmp_path), rdrop=RDropConfig())
    batch = {**bert_batch(), "labels": torch.tensor([0.5, 1.0, -0.2])}
    with pytest.raises(ValueError, match="logits have one output \\(a regression head\\)"):
        one_step(trainer, batch)


def test_two_gloo_ranks_without_find_unused_parameters(tmp_path):
    ranks = torchrun_ranks("rdrop_rank.py", tmp_path, timeout=300)
    assert all(r["world_size"] == 2 and r["find_unused_parameters"] is False for r in ranks)
    params = [r["params"] for r in ranks]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert any(not torch.equal(params[0][k], ranks[0]["initial"][k]) for k in params[0])  # it trained
    logs = [h for h in ranks[0]["log_history"] if "loss" in h]
    assert logs and all(h["rdrop_kl"] > 0 for h in logs)
    # the logged KL is the whole job's: both ranks' sums over both ranks' positions
    (k0, n0), (k1, n1) = ranks[0]["local"][0], ranks[1]["local"][0]
    assert logs[0]["rdrop_kl"] == pytest.approx((k0 + k1) / (n0 + n1), abs=1e-6)
