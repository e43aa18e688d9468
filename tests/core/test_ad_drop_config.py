"""core.ad_drop: ADDropConfig's accepted ranges and how its errors name an option, the cross-tuning
epoch rule, and frozen parameters restored."""

import pytest
import torch

from attn_reg_plugin.core.kernel.attention_call import active_plan
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig, ad_drop_epoch
from attn_reg_plugin.core.regularizers.attribution_pass import frozen_parameters
from helpers import controller_with_sites


@pytest.mark.parametrize("name", ["p", "q"])
@pytest.mark.parametrize("value", [0, 1, 0.0, 1.0, -0.1, 1.5, float("nan"), float("inf"), "0.5", None])
def test_config_rejects_p_q_outside_open_unit_interval(name, value):
    with pytest.raises(ValueError) as e:
        ADDropConfig(**{name: value}).validate()
    assert f"--ad-drop-{name}" in str(e.value) and "(0, 1)" in str(e.value)


@pytest.mark.parametrize("value", ["0.5", None, True])
def test_config_says_a_p_that_is_no_number_is_no_number(value):
    with pytest.raises(ValueError, match=r"^--ad-drop-p must be an int or float in the open interval \(0, 1\), got "):
        ADDropConfig(p=value).validate()


@pytest.mark.parametrize("value", [1e-6, 0.5, 0.999999])
def test_config_accepts_p_q_inside(value):
    config = ADDropConfig(p=value, q=value)
    assert config.validate() is config and (config.p, config.q) == (value, value)  # accepted as given, not clamped


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("attribution", "gradient", "--ad-drop-attribution"),
        ("labels", "silver", "--ad-drop-labels"),
        ("schedule", "sometimes", "--ad-drop-schedule"),
        ("iga_steps", 0, "--ad-drop-iga-steps"),
        ("iga_steps", -2, "--ad-drop-iga-steps"),
        ("iga_steps", 2.5, "--ad-drop-iga-steps"),
        ("layers", "x", "--ad-drop-layers"),
        ("attention", "encoder", "--ad-drop-attention"),
    ],
)
def test_config_errors_name_their_flag(field, value, flag):
    with pytest.raises(ValueError) as e:
        ADDropConfig(**{field: value}).validate()
    assert flag in str(e.value)


def test_config_marked_by_a_python_api_names_its_fields():
    from attn_reg_plugin.core.regularizers.options import named_by_field

    with pytest.raises(ValueError, match=r"^ADDropConfig\.q must be in the open interval"):
        named_by_field(ADDropConfig(q=2.0)).validate()
    with pytest.raises(ValueError, match=r"^ADDropConfig\.layers: layer 5 does not exist"):
        ADDrop(named_by_field(ADDropConfig(layers="5")), controller_with_sites({"encoder-self": 2}))
    assert named_by_field(ADDropConfig(q=0.3)) == ADDropConfig(q=0.3)  # the mark is not a field


def test_config_from_namespace():
    class NS:
        ad_drop_p = 0.6
        ad_drop_q = 0.1
        ad_drop_layers = "0"
        unrelated = 3

    cfg = ADDropConfig.from_namespace(NS())
    assert (cfg.p, cfg.q, cfg.layers, cfg.attribution) == (0.6, 0.1, "0", "ga")


def test_ad_drop_epoch():
    assert [ad_drop_epoch("cross-tuning", e) for e in range(1, 7)] == [False, True, False, True, False, True]
    assert all(ad_drop_epoch("always", e) for e in range(1, 7))  # epoch 0 is refused: test_ad_drop_epochs_are_one_based
    with pytest.raises(ValueError, match="schedule"):
        ad_drop_epoch("never", 2)


def test_frozen_parameters_restores_requires_grad():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    m[1].bias.requires_grad_(False)
    with frozen_parameters(m):
        assert not any(p.requires_grad for p in m.parameters())
    assert [p.requires_grad for p in m.parameters()] == [True, True, True, False]
    with pytest.raises(KeyError):
        with frozen_parameters(m):
            raise KeyError
    assert [p.requires_grad for p in m.parameters()] == [True, True, True, False]


# -- the candidate region: top-p (AD-DROP) or bottom-p (analysis) ------------------------------------
def _masks_for(region, attribution, valid, p, monkeypatch):
    """The drops of the rule ADDrop.masked sets from hand-built attributions, its q made 1 (every
    candidate dropped, but a row's last valid key), made as the kernel makes a one-block call's."""
    import dataclasses

    from attn_reg_plugin.core.regularizers import ad_drop as core_ad_drop

    controller = controller_with_sites({"encoder-self": 1})
    ad_drop = ADDrop(ADDropConfig(p=p, q=0.5, region=region, attention="encoder-self"), controller)
    (site,) = ad_drop.sites
    monkeypatch.setattr(
        core_ad_drop.ADDrop,
        "attributions",
        lambda self, f, t, frozen=None, dense=True, labels=None, inputs=None: ([site], [attribution], [valid]),
    )
    with pytest.raises(RuntimeError, match="ran no forward"):  # the block only reads the pass it set
        with ad_drop.masked(lambda: None, None):
            hook, seed, _ = active_plan(site).of(site)
            rule = dataclasses.replace(hook.drop, q=1.0)
            drops = rule.whole(valid.expand(attribution.shape), seed)
    return drops


def test_region_top_drops_the_highest_and_bottom_the_lowest_attributions(monkeypatch):
    attribution = torch.tensor([[[[0.9, -0.5, 0.1, 0.7, 0.3, 5.0]]]])  # key 5 is padding
    valid = torch.tensor([[[[True, True, True, True, True, False]]]])
    top = _masks_for("top", attribution, valid, 0.4, monkeypatch)  # ceil(0.4 * 5) = 2 candidates
    bottom = _masks_for("bottom", attribution, valid, 0.4, monkeypatch)
    assert top.squeeze().tolist() == [True, False, False, True, False, False]
    assert bottom.squeeze().tolist() == [False, True, True, False, False, False]  # padding never a candidate


def test_region_bottom_keeps_the_highest_key_of_an_emptied_row(monkeypatch):
    attribution = torch.tensor([[[[0.2, 0.9, -0.4]]]])
    valid = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    # p near 1: every valid key is a candidate; the never-empty rule keeps one, the one the region
    # wants least: the lowest attribution for top, the highest for bottom.
    assert _masks_for("top", attribution, valid, 0.99, monkeypatch).squeeze().tolist() == [True, True, False]
    assert _masks_for("bottom", attribution, valid, 0.99, monkeypatch).squeeze().tolist() == [True, False, True]


@pytest.mark.parametrize(
    "attribution,why", [("rd", "draws its region at random"), ("aa", "ranks by attention weights")]
)
def test_region_bottom_is_refused_where_it_means_nothing(attribution, why):
    with pytest.raises(
        ValueError,
        match=f"--ad-drop-region bottom ranks keys by attribution, but --ad-drop-attribution {attribution} {why}",
    ):
        ADDropConfig(region="bottom", attribution=attribution).validate()
    ADDropConfig(region="top", attribution=attribution).validate()
    ADDropConfig(region="bottom", attribution="iga").validate()
