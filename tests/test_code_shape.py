"""What the plugin's code must not do, whatever its size: call torch's private API, or name a regularizer
outside its own module and the registry's loading of it. (The line caps
this file held, 600 lines a module, 60 a function, 500 a lab module, are withdrawn: they bent the
code. Size is for review; what a reader must follow is measured by ../shared/tools/reading_load.py.)"""

from helpers import REPO

MODULES = sorted((REPO / "attn_reg_plugin").rglob("*.py"))


def test_the_plugin_uses_no_private_torch_api():
    """``torch._C`` may change in any release: nothing in the plugin calls it."""
    found = [
        f"{m.relative_to(REPO)}:{n}"
        for m in MODULES
        for n, line in enumerate(m.read_text().splitlines(), 1)
        if "torch._C" in line
    ]
    assert not found, found


def test_a_regularizer_is_named_only_by_its_module_the_registry_and_the_core_exports():
    """DropHead, a plan regularizer, as the registry design promises: every adapter and command reaches it
    through the registry (it was named in 13 plugin files before the registry)."""
    naming = sorted(str(m.relative_to(REPO)) for m in MODULES if "drophead" in m.read_text().lower())
    assert naming == [
        "attn_reg_plugin/core/__init__.py",  # the porting API's export
        "attn_reg_plugin/core/regularizers/drophead.py",
        "attn_reg_plugin/core/regularizers/registry.py",  # PLUGIN_MODULES
    ]
