"""The launches of one regularized attention call on the GPU route (ATTN_REG_PORTABLE's branches), counted
by attn-reg-gpu-cost's counter: a step of small calls is bound by them on a GPU (docs/PERFORMANCE.md,
"The GPU route counted on the CPU"), so a change that adds some shows here. The bounds are the counts
at the commit that cut them (3c3cbc7), recounted once the counter took keyed_draws' output for a device
tensor, as a GPU makes it (the launches that read it were missed before)."""

import pytest
import torch

from attn_reg_lab.gpu_cost import CostCounter
from attn_reg_plugin.core.kernel import devices
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import AttentionSite, EditScores, Plan, Record
from attn_reg_plugin.core.kernel.rules import MapScores, TopRegionRule
from attn_reg_plugin.core.regularizers.attendout.policy import GeneratorRule, PolicyLogits

DEVICE = torch.device("cpu")  # named: the counter takes a tensor made on a named device for the device's


def _hook(rule: str) -> EditScores:
    g = torch.Generator().manual_seed(6)
    if rule == "region":
        scores = torch.randint(0, 3, (4, 3, 9, 9), generator=g).float().to(DEVICE)  # ties straddle thresholds
        return EditScores(drop=TopRegionRule(MapScores(scores), 0.5, 0.7), counted=True)
    real = torch.ones(4, 9, dtype=torch.bool, device=DEVICE)
    real[1, -3:] = False
    query, key = (torch.randn(4, 9, 4, generator=g).to(DEVICE) for _ in range(2))
    policy = PolicyLogits(query, key, torch.tensor(-0.5, device=DEVICE), real, real, False)
    droppable = (policy.query_real[:, None, :, None], policy.key_real[:, None, None, :])
    return EditScores(drop=GeneratorRule(policy, torch.tensor(3)), counted=True, droppable=droppable)


def _call(hook: EditScores, dropout_p: float) -> None:
    """A transformers layer's call (strided q, k, v; a padded batch's bool mask), forward and backward."""
    g = torch.Generator().manual_seed(5)
    b, h, t, d = 4, 3, 9, 8
    q, k, v = (torch.randn(b, t, h, d, generator=g).to(DEVICE).transpose(1, 2).requires_grad_() for _ in range(3))
    lengths = torch.tensor([t, t - 3, 1, t - 1], device=DEVICE)
    valid = (torch.arange(t, device=DEVICE)[None, :] < lengths[:, None])[:, None, None, :]
    site, record = AttentionSite("encoder-self", 0), Record()
    plan = Plan.asking({site: hook}, record, {site: torch.tensor(17)})
    out, _ = attend(q, k, v, bias=valid, dropout_p=dropout_p, site=site, plan=plan)
    torch.autograd.grad((out * torch.randn(out.shape, generator=g).to(DEVICE)).sum(), (q, k, v))
    record.counts()


@pytest.mark.parametrize(
    "rule,dropout_p,bound",
    [("region", 0.1, 72), ("region", 0.0, 68), ("generator", 0.1, 62), ("generator", 0.0, 58)],
)
def test_a_regularized_call_of_one_block_launches_at_most_its_bound(rule, dropout_p, bound, monkeypatch):
    monkeypatch.setattr(devices, "PORTABLE", True)
    hook = _hook(rule)
    _call(hook, dropout_p)  # once uncounted, as the counter's steps
    counter = CostCounter()
    with counter.counting(), counter.recorded() as cost:
        _call(hook, dropout_p)
    assert cost.plugin_syncs == 0
    assert cost.launches <= bound, dict(cost.launch_sites)
