"""The regularizer registry (core/regularizers/registry.py): what it holds, and what it refuses."""

import dataclasses

import pytest

from attn_reg_plugin.core.regularizers import registry
from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
from attn_reg_plugin.core.regularizers.registry import EXTENSIONS_ENV, Regularizer, by_key, register, registered


def test_the_plugins_one_pass_regularizers_are_registered_in_order_with_their_methods():
    plugin = [r for r in registered() if r.config.__module__.startswith("attn_reg_plugin.")]
    assert [r.key for r in plugin] == ["scheduled_dropout", "layerdrop", "drophead"]
    assert [m.name for r in plugin for m in r.methods] == ["dropkey", "drophead"]
    assert by_key("drophead").names == ("DropHead",) and by_key("scheduled_dropout").names[1] == "DropKey"


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
    from attn_reg_plugin.hf.methods import METHODS as classifier_methods
    from attn_reg_plugin.sweep.methods import METHODS as mt_methods

    names = registry.method_names()
    assert names[:5] == ("plain", "ad-drop", "attendout", "r-drop", "hiddencut") and names[-1] == "ad-drop-r-drop"
    assert {"drophead", "dropkey"} <= set(names)
    assert list(classifier_methods) == list(mt_methods) == list(names)


def test_a_method_table_that_binds_other_names_is_refused():
    bound = {name: name for name in ("plain", *registry.OWN_PASS_METHODS, *registry.COMBINED_METHODS)}
    assert list(registry.method_table(bound, lambda r, m: m.name)) == list(registry.method_names())
    with pytest.raises(ValueError, match="a method table binds exactly"):
        registry.method_table({**bound, "drophead": "mine"}, lambda r, m: m.name)
    with pytest.raises(ValueError, match="a method table binds exactly"):
        registry.method_table({k: v for k, v in bound.items() if k != "hiddencut"}, lambda r, m: m.name)
