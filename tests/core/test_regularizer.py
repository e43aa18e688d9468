"""The regularizer registry (core/regularizers/registry.py): what it holds, and what it refuses."""

import dataclasses

import pytest

from attn_reg_plugin.core.regularizers import registry
from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
from attn_reg_plugin.core.regularizers.registry import EXTENSIONS_ENV, Regularizer, by_key, register, registered


def test_every_regularizer_of_the_plugin_is_registered_in_order_with_its_methods():
    plugin = [r for r in registered() if r.config.__module__.startswith("attn_reg_plugin.")]
    assert [r.key for r in plugin] == [
        *("ad_drop", "attendout", "rdrop", "hiddencut"),  # their own passes
        *("scheduled_dropout", "layerdrop", "drophead"),  # a plan of the training forward
    ]
    assert [r.passes for r in plugin] == [registry.OWN_PASSES] * 4 + [registry.PLAN] * 3
    assert [r.key for r in registry.planned() if r in plugin] == ["scheduled_dropout", "layerdrop", "drophead"]
    assert [m.name for r in plugin for m in r.methods] == [
        "ad-drop",
        "attendout",
        "r-drop",
        "hiddencut",
        "dropkey",
        "drophead",
    ]
    assert by_key("drophead").names == ("DropHead",) and by_key("scheduled_dropout").names[1] == "DropKey"
    assert [by_key(k).name for k in ("ad_drop", "attendout", "rdrop", "hiddencut")] == [
        "AD-DROP", "AttendOut", "R-Drop", "HiddenCut"
    ]  # fmt: skip


def test_a_plan_regularizer_without_a_switch_or_a_build_is_refused():
    with pytest.raises(ValueError, match="a plan regularizer needs its switch and build"):
        register(dataclasses.replace(by_key("drophead"), key="other", name="Other", build=None))
    with pytest.raises(ValueError, match="Regularizer.passes must be"):
        register(dataclasses.replace(by_key("drophead"), key="other", name="Other", passes="twice"))


@pytest.mark.parametrize(
    "change, clash",
    [
        (dict(key="drophead", log_prefix="other"), "key"),
        (dict(key="other", name="DropHead", log_prefix="other"), "name"),
        (dict(key="other", log_prefix="attn_drophead"), "log prefix"),
    ],
)
def test_a_registration_that_clashes_is_refused_naming_what_and_with_whom(change, clash):
    before = registered()
    clone = dataclasses.replace(by_key("drophead"), methods=(), **{"name": "Other", **change})
    with pytest.raises(ValueError, match=f"its .*{clash}.* already belong to 'DropHead'"):
        register(clone)
    assert registered() == before  # nothing half-registered


def test_a_flag_prefix_of_another_regularizer_is_refused():
    @dataclasses.dataclass
    class Same(DropHeadConfig):
        pass

    clone = dataclasses.replace(by_key("drophead"), key="same", name="Same", log_prefix="same", methods=(), config=Same)
    with pytest.raises(ValueError, match="flag prefix"):
        register(clone)


def test_a_key_that_is_no_keyword_is_refused():
    with pytest.raises(ValueError, match="Regularizer.key must be a Python keyword-like name"):
        register(dataclasses.replace(by_key("drophead"), key="Drop-Head"))


def test_an_extension_that_cannot_be_loaded_fails_naming_it(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere.py"
    monkeypatch.setenv(EXTENSIONS_ENV, str(missing))
    with pytest.raises(ImportError, match=f"{EXTENSIONS_ENV}: cannot load '{missing}': no such file"):
        registry.load_extensions()
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('a bug in the extension')\n")
    monkeypatch.setenv(EXTENSIONS_ENV, str(broken))
    with pytest.raises(ImportError, match="a bug in the extension"):
        registry.load_extensions()
    monkeypatch.setenv(EXTENSIONS_ENV, "")
    assert isinstance(registered()[0], Regularizer)  # the registry still reads


def test_both_comparison_commands_list_the_same_methods_in_one_order():
    from attn_reg_plugin.core.regularizers.comparison_methods import method_names
    from attn_reg_plugin.hf.methods import METHODS as classifier_methods
    from attn_reg_plugin.sweep.methods import METHODS as mt_methods

    names = method_names()
    assert names[:5] == ("plain", "ad-drop", "attendout", "r-drop", "hiddencut") and names[-1] == "ad-drop-r-drop"
    assert {"drophead", "dropkey"} <= set(names)
    assert list(classifier_methods) == list(mt_methods) == list(names)


def test_the_method_tables_come_from_the_registry_alone():
    from attn_reg_plugin.core.regularizers.comparison_methods import comparison_methods, method_names, method_table

    table = method_table("reference", lambda method: [r.key for r, _ in method.parts])
    assert list(table) == list(method_names())
    assert table["plain"] == "reference" and table["ad-drop"] == ["ad_drop"] and table["drophead"] == ["drophead"]
    assert table["ad-drop-r-drop"] == ["ad_drop", "rdrop"]  # the combination takes its parts' options
    combined = comparison_methods()["ad-drop-r-drop"]
    assert combined.mt_defaults == (("--rdrop-alpha", "5"),) and combined.flag_prefixes == ("--ad-drop-", "--rdrop-")
    assert combined.log_keys == ("ad_drop_on", "ad_drop_rate", "rdrop_kl")


def test_a_method_named_as_the_reference_or_a_combination_is_refused(monkeypatch):
    from attn_reg_plugin.core.regularizers import comparison_methods

    drophead = by_key("drophead")
    as_plain = dataclasses.replace(drophead.methods[0], name="plain")
    with pytest.raises(ValueError, match="'plain' is the comparison commands' reference"):
        register(dataclasses.replace(drophead, key="other", name="Other", methods=(as_plain,)))
    as_combination = dataclasses.replace(drophead.methods[0], name="ad-drop-r-drop")
    monkeypatch.setattr(registry, "methods", lambda: {"ad-drop-r-drop": (drophead, as_combination)})
    monkeypatch.setattr(comparison_methods, "methods", registry.methods)
    with pytest.raises(ValueError, match="its method 'ad-drop-r-drop' is the name of the combination"):
        comparison_methods.comparison_methods()


def test_a_regularizer_of_its_own_passes_names_what_trains_it_in_each_framework():
    rdrop = by_key("rdrop")
    own = dict(key="other", name="Other", log_prefix="other", config=DropHeadConfig)
    untrained = dataclasses.replace(rdrop.methods[0], name="other", fairseq_criterion=None)
    with pytest.raises(ValueError, match="names what trains it in fairseq"):
        register(dataclasses.replace(rdrop, methods=(untrained,), **own))
    plan_trainer = dataclasses.replace(rdrop.methods[0], name="other", trainer="AttnRegTrainer")
    with pytest.raises(ValueError, match="AttnRegTrainer runs plan regularizers only"):
        register(dataclasses.replace(rdrop, methods=(plan_trainer,), **own))


def test_a_method_may_name_a_trainer_of_its_own():
    from attn_reg_plugin.hf.methods import trainer_class

    assert trainer_class("RDropTrainer").__name__ == "RDropTrainer"
    assert trainer_class("collections:OrderedDict") is __import__("collections").OrderedDict


def test_too_few_epochs_names_the_setting_where_the_method_gives_it():
    from attn_reg_plugin.core.regularizers.comparison_methods import (
        ComparisonMethod,
        comparison_methods,
        too_few_epochs,
    )

    ad_drop = comparison_methods()["ad-drop"]
    config = by_key("ad_drop").config()
    assert too_few_epochs(ad_drop, {"ad_drop": config}, 2) is None
    assert too_few_epochs(ad_drop, {"ad_drop": config}, 1) == (
        "--epochs 1 with ad-drop's --ad-drop-schedule cross-tuning never runs AD-DROP (its first AD-DROP epoch is "
        "epoch 2): give --epochs >= 2, or --method-args 'ad-drop=--ad-drop-schedule always'"
    )
    drophead = by_key("drophead")
    slow = dataclasses.replace(drophead.methods[0], min_epochs=lambda config: 3)
    assert too_few_epochs(ComparisonMethod(slow, ((drophead, slow),)), {"drophead": None}, 2) == (
        "--epochs 2 with drophead never runs DropHead (its first DropHead epoch is epoch 3): give --epochs >= 3"
    )
