"""ADDropConfig(labels="gold") through the core API: ``masked(..., labels=gold)`` hands the gold
labels to the attribution target (in place of pass 1's argmax), so the drop masks follow them; a
gold config without labels, or labels under pseudo labels, is refused rather than silently run on
pseudo labels (only the fairseq and HF adapters used to pass gold labels)."""

import pytest
import torch

from attn_reg_plugin.core.kernel import blockwise
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attribution import logit_target
from helpers import CORE_B, CORE_D, CORE_T, tiny_core_model


def _x():
    return torch.randn(CORE_B, CORE_T, CORE_D, generator=torch.Generator().manual_seed(1))


def _step(labels_option, labels=None, attribution="ga"):
    """One masked step of the tiny 3-class model: (each call's drops, what the target was called with
    and returned: [(labels in, F, labels used)])."""
    model, x = tiny_core_model(), _x()
    model.eval()  # no hidden dropout: pass 1 is the same function whatever the labels
    config = ADDropConfig(p=0.5, q=0.9, schedule="always", attribution=attribution, iga_steps=3, labels=labels_option)
    ad_drop = ADDrop(config, model.controller)
    calls, drops = [], []

    def target(logits, fixed):
        value, used = logit_target(logits, fixed)
        calls.append((fixed, value.detach(), used))
        return value, used

    rule_drops = blockwise.rule_drops
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockwise, "rule_drops", lambda *args: drops.append(rule_drops(*args)) or drops[-1])
        torch.manual_seed(0)
        given = {} if labels is None else {"labels": labels}  # none given: as a loop of before wrote it
        with ad_drop.masked(lambda: model(x), target, frozen=model, **given):
            model(x)
    return [d[0] for d in drops], calls


def _pseudo_and_gold():
    model, x = tiny_core_model(), _x()
    model.eval()
    with torch.no_grad():
        logits = model(x)
    pseudo = logits.argmax(-1)
    return logits, pseudo, (pseudo + 1) % 3  # every gold label differs from the argmax


@pytest.mark.parametrize("attribution", ["ga", "iga"])
def test_gold_labels_are_the_target_and_move_the_masks(attribution):
    logits, pseudo, gold = _pseudo_and_gold()
    pseudo_drops, pseudo_calls = _step("pseudo", attribution=attribution)
    gold_drops, gold_calls = _step("gold", gold, attribution)
    # Pseudo: the first call gets None and uses the argmax; gold: every call gets the gold labels.
    assert pseudo_calls[0][0] is None and torch.equal(pseudo_calls[0][2], pseudo)
    assert all(torch.equal(fixed, gold) and torch.equal(used, gold) for fixed, _, used in gold_calls)
    # F of the model's own forward (the first call) is the sum of the gold classes' logits, by hand.
    hand = sum(float(logits[i, int(gold[i])]) for i in range(len(gold)))
    assert float(gold_calls[0][1]) == pytest.approx(hand, rel=1e-5)
    assert float(pseudo_calls[0][1]) == pytest.approx(float(logits.max(-1).values.sum()), rel=1e-5)
    # The same coins (seed 0), another attribution target: other candidates, other drops.
    assert len(gold_drops) == len(pseudo_drops) == 2
    assert any(not torch.equal(g, p) for g, p in zip(gold_drops, pseudo_drops))
    # Gold labels that are the argmax give pseudo labels' masks exactly.
    same_drops, _ = _step("gold", pseudo.clone(), attribution)
    assert all(torch.equal(s, p) for s, p in zip(same_drops, pseudo_drops))


@pytest.mark.parametrize("attribution", ["ga", "iga", "aa", "rd"])
def test_a_gold_config_without_labels_is_refused(attribution):
    with pytest.raises(ValueError, match=r"--ad-drop-labels is gold.*labels=.*pseudo labels"):
        _step("gold", None, attribution)


def test_labels_under_pseudo_labels_are_refused():
    _, _, gold = _pseudo_and_gold()
    with pytest.raises(ValueError, match=r"labels were given, but --ad-drop-labels is pseudo"):
        _step("pseudo", gold)


def test_the_attribution_pass_alone_takes_gold_labels_too():
    _, _, gold = _pseudo_and_gold()
    model, x = tiny_core_model(), _x()
    ad_drop = ADDrop(ADDropConfig(labels="gold"), model.controller)
    seen = []

    def target(logits, fixed):
        seen.append(fixed)
        return logit_target(logits, fixed)

    with pytest.raises(ValueError, match=r"--ad-drop-labels is gold"):
        ad_drop.attributions(lambda: model(x), target, frozen=model)
    ad_drop.attributions(lambda: model(x), target, frozen=model, labels=gold)
    assert len(seen) == 1 and torch.equal(seen[0], gold)
