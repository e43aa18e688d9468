"""The adapters of a regularizer of its own passes run whichever step the registry declares: a toy
regularizer registered here (two passes, alpha times the squared distance of their probabilities) trains
through ``OwnPassesTrainerMixin`` and ``OwnPassesCriterion`` with no line of them naming it; its loss is
rebuilt by hand from the same dropout draws, and its declared number reaches both frameworks' logs."""

from dataclasses import dataclass

import pytest
import torch

from attn_reg_plugin.core.regularizers import registry
from attn_reg_plugin.core.regularizers.options import RegularizerOptions, option
from attn_reg_plugin.core.regularizers.training_step import Logged, StepResult, two_passes

pytest.importorskip("transformers")


@dataclass
class AgreementConfig(RegularizerOptions):
    FLAG_PREFIX = "--agreement-"

    alpha: float = option(1.0, "weight of the squared distance of the two passes' probabilities", "number >= 0")

    def validate(self):
        return self


def _probabilities(scores, log_probs):
    return scores.float().exp() if log_probs else scores.float().softmax(-1)


def agreement_step(config, step, sites):
    pair_loss, first, second = two_passes(step, doubled=False)
    compared = step.compared(first, second, "the agreement term")
    gap = _probabilities(compared.first, step.log_probs) - _probabilities(compared.second, step.log_probs)
    distance = gap.pow(2).sum(-1)
    if compared.keep is None:
        total, positions = distance.sum(), torch.tensor(distance.numel())
    else:
        total, positions = distance.masked_fill(~compared.keep, 0.0).sum(), compared.keep.sum()
    loss = pair_loss + config.alpha * step.reduced(total, positions, pair_loss, compared)
    return StepResult(loss, first, second, {"agreement_sum": total.detach(), "agreement_positions": positions})


@pytest.fixture
def agreement(monkeypatch):
    """Registered for this test only (the registry restored after it)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry._ordered.cache_clear()
    registered = registry.register(
        registry.Regularizer(
            "agreement",
            "Agreement",
            AgreementConfig,
            "",
            None,
            "agreement",
            passes=registry.OWN_PASSES,
            step=agreement_step,
            logged=(Logged("agreement", "agreement_sum", "agreement_positions", divergence=False),),
        )
    )
    yield registered
    registry._ordered.cache_clear()


def test_a_trainer_runs_the_declared_step_and_logs_its_number(agreement, tmp_path):
    import transformers

    from attn_reg_plugin.hf import OwnPassesTrainerMixin
    from helpers import tiny_bert_classifier

    class AgreementTrainer(OwnPassesTrainerMixin, transformers.Trainer):
        own_passes = "agreement"

        def __init__(self, *args, agreement, **kwargs):
            self.agreement = agreement
            super().__init__(*args, **kwargs)

    model = tiny_bert_classifier(
        hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100, hidden_dropout_prob=0.3
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", remove_unused_columns=False
    )
    trainer = AgreementTrainer(model=model, args=args, agreement=AgreementConfig(alpha=2.0))
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, 100, (3, 7), generator=g), "labels": torch.tensor([0, 1, 1])}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(5)
    loss = trainer.training_step(trainer.model, batch).detach()
    torch.manual_seed(5)
    with torch.no_grad():
        one, two = model(**batch), model(**batch)
    distance = (one.logits.softmax(-1) - two.logits.softmax(-1)).pow(2).sum(-1)
    assert distance.sum() > 0
    torch.testing.assert_close(loss, one.loss + two.loss + 2.0 * distance.mean(), rtol=1e-5, atol=1e-6)
    trainer.log({"loss": float(loss)})
    assert trainer.state.log_history[-1]["agreement"] == round(float(distance.mean()), 6)
    model.eval()
    with torch.no_grad():  # evaluation: one pass, the model's loss
        torch.testing.assert_close(trainer.compute_loss(model, batch), model(**batch).loss)


def test_a_criterion_runs_the_declared_step_and_reduces_its_number(agreement, tiny_mt_data):
    pytest.importorskip("fairseq")
    from fairseq import metrics
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    from attn_reg_plugin.fairseq_plugin.own_passes_criterion import OwnPassesCriterion
    from helpers import TINY_TRANSFORMER, fairseq_setup

    class AgreementCriterion(OwnPassesCriterion):
        own_passes = "agreement"
        name = "agreement_label_smoothed_cross_entropy"

    torch.manual_seed(0)
    _, task, model, _ = fairseq_setup(
        tiny_mt_data["bin"],
        ["--task", "translation", *TINY_TRANSFORMER, "--dropout", "0.3", "--optimizer", "adam"],
    )
    criterion = AgreementCriterion(task, sentence_avg=False, label_smoothing=0.1)
    criterion.agreement_config = AgreementConfig(alpha=2.0)
    task.load_dataset("train")
    sample = next(iter(task.get_batch_iterator(task.dataset("train"), max_tokens=400, seed=1).next_epoch_itr()))
    model.train()
    torch.manual_seed(3)
    loss, sample_size, log = criterion(model, sample)
    torch.manual_seed(3)
    with torch.no_grad():
        lprobs = [criterion.get_lprobs_and_target(model, model(**sample["net_input"]), sample) for _ in range(2)]
    target = lprobs[0][1]
    keep = target.ne(criterion.padding_idx)
    ce = sum(label_smoothed_nll_loss(lp, target, 0.1, ignore_index=criterion.padding_idx)[0] for lp, _ in lprobs)
    distance = (lprobs[0][0].exp() - lprobs[1][0].exp()).pow(2).sum(-1).masked_fill(~keep, 0.0).sum()
    torch.testing.assert_close(loss.detach(), ce + 2.0 * distance, rtol=1e-5, atol=1e-4)
    assert sample_size == sample["ntokens"] and int(log["agreement_positions"]) == sample["ntokens"]
    with metrics.aggregate(new_root=True) as aggregated:
        AgreementCriterion.reduce_metrics([log])
        reduced = aggregated.get_smoothed_values()
    # not a divergence: the same unit in both frameworks (no division by ln 2)
    assert reduced["agreement"] == pytest.approx(float(distance) / sample["ntokens"], abs=1e-5)
