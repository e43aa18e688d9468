"""DropKey (Li et al., CVPR 2023) as the scheduled attention dropout's preset ``dropkey:RATE``:
layer l of a stack of L dropped at RATE * (1 - l / L), constant over training, through the same
kernel (a dropped key gets the masked fill before softmax; a row that loses every key is uniform)."""

import math

import pytest
import torch

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.regularizers.options import named_by_field
from attn_reg_plugin.core.regularizers.planned_run import idle_run_warning
from attn_reg_plugin.core.regularizers.scheduled_dropout import (
    ScheduledAttentionDropout,
    ScheduledDropoutConfig,
    check_dropkey_rate,
    dropkey_rates,
)
from helpers import controller_with_sites

OPT = "--attn-sched-dropout-schedule"


def dropkey(spec, controller, **site_options):
    return ScheduledAttentionDropout(ScheduledDropoutConfig(schedule=spec, **site_options), controller)


# -- the formula --------------------------------------------------------------------------------
def test_rates_fall_linearly_from_the_base_rate_towards_zero():
    assert dropkey_rates(0.4, 4) == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert dropkey_rates(0.1, 1) == [0.1]  # one layer keeps the base rate
    assert dropkey_rates(0.3, 6) == pytest.approx([0.3, 0.25, 0.2, 0.15, 0.1, 0.05])
    assert dropkey_rates(0.0, 3) == [0.0, 0.0, 0.0]


def test_each_layer_gets_its_depth_rate_at_every_update():
    sched = dropkey("dropkey:0.4", controller_with_sites({"encoder-self": 4}))
    for update in (0, 1, 10_000):
        assert sched.probabilities(update) == pytest.approx({0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1})


def test_depth_is_the_stacks_not_the_selections():
    """layers='1,3' of 4: the rates of depths 1 and 3 in the 4-layer stack, not a 2-layer line."""
    sched = dropkey("dropkey:0.4", controller_with_sites({"encoder-self": 4}), layers="1,3")
    assert sched.probabilities(0) == pytest.approx({1: 0.3, 3: 0.1})
    assert {(s.kind, s.layer) for s in sched.sites} == {("encoder-self", 1), ("encoder-self", 3)}


def test_kinds_of_one_depth_share_each_layers_rate():
    controller = controller_with_sites({"encoder-self": 2, "decoder-self": 2, "encoder-decoder": 2})
    sched = dropkey(" DropKey:0.5 ", controller, attention="encoder-self,decoder-self,encoder-decoder")
    assert sched.probabilities(0) == pytest.approx({0: 0.5, 1: 0.25})
    hooks = sched.hooks(0)
    assert len(hooks) == 6
    assert all(float(hooks[s].drop.probability) == pytest.approx(0.5 / (1 + s.layer)) for s in controller.sites)


def test_kinds_of_different_depths_are_refused():
    controller = controller_with_sites({"encoder-self": 3, "decoder-self": 2})
    with pytest.raises(ValueError) as e:
        dropkey("dropkey:0.2", controller, attention="encoder-self,decoder-self")
    assert str(e.value) == (
        "--attn-sched-dropout-schedule dropkey:0.2: the selected attention kinds have different layer counts "
        "({'encoder-self': 3, 'decoder-self': 2}), so a layer index has no single DropKey rate; select kinds "
        "of one depth with --attn-sched-dropout-attention"
    )


# -- what the kernel applies ----------------------------------------------------------------------
def _qkv(shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator).to(dtype) for _ in range(3))


def test_kernel_drops_each_layer_at_its_rate():
    """Counted by the kernel per layer: within 0.01 of RATE * (1 - l/L) (about 65k units, std < 0.002)."""
    controller = controller_with_sites({"encoder-self": 4})
    sched = dropkey("dropkey:0.6", controller)
    q, k, v = _qkv((4, 4, 64, 8))
    torch.manual_seed(0)
    for site, expected in zip(controller.sites, (0.6, 0.45, 0.3, 0.15)):
        with controller.hooks({site: sched.hooks(0)[site]}) as record:
            out, _ = attend(q, k, v, site=site)
        counts = record.counts()
        assert torch.isfinite(out).all()
        assert counts[1].item() == 4 * 4 * 64 * 64
        assert abs(counts[0].item() / counts[1].item() - expected) < 0.01, (site, expected)


def test_same_seed_same_drops_other_seed_other_drops():
    controller = controller_with_sites({"encoder-self": 2})
    sched = dropkey("dropkey:0.5", controller)
    q, k, v = _qkv((2, 2, 16, 8))
    site = controller.sites[0]

    def run(seed):
        torch.manual_seed(seed)
        with controller.hooks({site: sched.hooks(7)[site]}):
            return attend(q, k, v, site=site)[0]

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_that_loses_every_key_attends_uniformly_never_nan(dtype):
    """Two keys, scores +10 and -10: a row attends to key 0 (output 1), to key 1 when key 0 is dropped
    (output -1), and uniformly when both are (output 0, not NaN), at rate 0.9: 81% of rows. A padded
    sample with one real key that drops it attends to that key alone. A row made uniform is counted
    as no drops (the kernel counts the keys it masked), so at this rate the logged rate is far below 0.9."""
    controller = controller_with_sites({"encoder-self": 1})
    sched = dropkey("dropkey:0.9", controller)
    site = controller.sites[0]
    b, h, t = 4, 2, 64
    q = torch.ones(b, h, t, 1, dtype=dtype)
    k = torch.tensor([10.0, -10.0], dtype=dtype).view(1, 1, 2, 1).expand(b, h, 2, 1)
    v = torch.tensor([1.0, -1.0], dtype=dtype).view(1, 1, 2, 1).expand(b, h, 2, 1)
    real = torch.tensor([[True, True]] * (b - 1) + [[True, False]])  # the last sample: one real key
    torch.manual_seed(0)
    with controller.hooks({site: sched.hooks(0)[site]}) as record:
        out, _ = attend(q, k, v, bias=real[:, None, None, :], site=site)
    counts = record.counts()
    assert torch.isfinite(out).all()
    out = out.float().squeeze(-1)
    assert torch.allclose(out[-1], torch.ones(h, t))  # its only key, dropped or not
    rows = out[:-1].flatten()
    nearest = torch.tensor([-1.0, 0.0, 1.0])[(rows[:, None] - torch.tensor([-1.0, 0.0, 1.0])).abs().argmin(1)]
    assert torch.allclose(rows, nearest, atol=1e-3)  # each row is one of the three cases
    n = rows.numel()  # 384 rows: binomial std < 0.025
    assert abs((nearest == 0).sum().item() / n - 0.81) < 0.08
    assert abs((nearest == -1).sum().item() / n - 0.09) < 0.06
    # The kernel counts the keys it dropped, a row made uniform instead all of its keys: both keys of
    # a uniform row, key 0 of a row at -1, key 1 of a row at +1 if dropped, and the last sample's key.
    minus, plus, uniform = ((nearest == x).sum().item() for x in (-1.0, 1.0, 0.0))
    assert counts[1].item() == 2 * (b - 1) * h * t + h * t  # the real units
    assert 2 * uniform + minus <= counts[0].item() <= 2 * uniform + minus + plus + h * t


# -- bad values, before training -------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, message",
    [
        ("dropkey:1", f"{OPT}: DropKey's rate must be a number in [0, 1), got 1.0"),
        ("dropkey:1.5", f"{OPT}: DropKey's rate must be a number in [0, 1), got 1.5"),
        ("dropkey:-0.1", f"{OPT}: DropKey's rate must be a number in [0, 1), got -0.1"),
        ("dropkey:nan", f"{OPT}: DropKey's rate must be a number in [0, 1), got nan"),
        ("dropkey:inf", f"{OPT}: DropKey's rate must be a number in [0, 1), got inf"),
        ("dropkey:abc", f"{OPT}: cannot read 'dropkey:abc'; expected dropkey:RATE such as dropkey:0.1"),
        ("dropkey", f"{OPT}: cannot read 'dropkey'; expected dropkey:RATE such as dropkey:0.1"),
        ("dropkeys:0.1", f"{OPT}: cannot read 'dropkeys:0.1'; expected dropkey:RATE such as dropkey:0.1"),
        ("dropkey:0.1|0:0.2", f"{OPT}: cannot read 'dropkey:0.1|0:0.2'; expected dropkey:RATE such as dropkey:0.1"),
    ],
)
def test_bad_spec_is_refused_by_validate_naming_the_option(spec, message):
    with pytest.raises(ValueError) as e:
        ScheduledDropoutConfig(schedule=spec).validate()
    assert str(e.value) == message


def test_bad_spec_named_by_field_for_python_callers():
    with pytest.raises(ValueError) as e:
        named_by_field(ScheduledDropoutConfig(schedule="dropkey:2")).validate()
    assert str(e.value) == "ScheduledDropoutConfig.schedule: DropKey's rate must be a number in [0, 1), got 2.0"


@pytest.mark.parametrize("value", [True, "0.1", None, 1, -1e-9, math.nan])
def test_rate_check_refuses_non_numbers_and_values_outside_0_1(value):
    with pytest.raises(ValueError, match=r"^opt: DropKey's rate must be a number in \[0, 1\), got "):
        check_dropkey_rate(value, "opt")
    assert check_dropkey_rate(0, "opt") == 0.0 and check_dropkey_rate(0.99, "opt") == 0.99


def test_a_zero_rate_never_drops_and_the_planned_run_warns():
    sched = dropkey("dropkey:0", controller_with_sites({"encoder-self": 2}))
    assert sched.hooks(0) == {}
    warning = idle_run_warning(ScheduledDropoutConfig(schedule="dropkey:0"), None, 100, "--max-update 100")
    assert warning.startswith("--attn-sched-dropout-schedule dropkey:0 is 0 at every one of the 100 updates")
    assert idle_run_warning(ScheduledDropoutConfig(schedule="dropkey:0.1"), None, 100, "--max-update 100") is None


def test_knot_schedules_are_unchanged():
    sched = dropkey("0:0.6,100:0.2|0:0.1,100:0.5", controller_with_sites({"encoder-self": 2}))
    assert sched.probabilities(50) == pytest.approx({0: 0.4, 1: 0.3})


# -- DropKey replaces the attention-weight dropout --------------------------------------------------
def _dropout_reaching_the_kernel(monkeypatch, hook, dropout_p):
    """The dropout_p that attend hands the kernel for one call under ``hook``."""
    from helpers import HandPass, kernel_dropout_at_hooked_calls

    seen = kernel_dropout_at_hooked_calls(monkeypatch)
    q = torch.randn(2, 2, 5, 4)
    attend(q, q, q, dropout_p=dropout_p, **HandPass(hook, seed=torch.tensor(3)).call)
    return seen


def test_at_a_dropkey_site_the_weights_dropout_is_off_and_a_knot_schedule_keeps_it(monkeypatch):
    controller = controller_with_sites({"encoder-self": 2})
    [site_hook, *_] = dropkey("dropkey:0.2", controller).hooks(0).values()
    assert site_hook.replaces_weight_dropout
    assert _dropout_reaching_the_kernel(monkeypatch, site_hook, 0.1) == [0.0]
    [knot_hook, *_] = dropkey("0:0.2", controller).hooks(0).values()
    assert not knot_hook.replaces_weight_dropout  # the AttendOut paper's scheduled dropout adds to it
    assert _dropout_reaching_the_kernel(monkeypatch, knot_hook, 0.1) == [0.1]


def test_the_start_up_log_says_so_once(caplog):
    with caplog.at_level("INFO", logger="attn_reg_plugin.core.regularizers.scheduled_dropout"):
        dropkey("dropkey:0.2", controller_with_sites({"encoder-self": 2}))
        dropkey("0:0.2", controller_with_sites({"encoder-self": 2}))
    said = [r.getMessage() for r in caplog.records if "replaces the attention-weight dropout" in r.getMessage()]
    assert said == [
        "--attn-sched-dropout-schedule dropkey:0.2: DropKey replaces the attention-weight dropout at its 2 "
        "attention sites (encoder-self[0], encoder-self[1]): the model's own attention dropout is off there in "
        "training, as in the DropKey paper"
    ]
