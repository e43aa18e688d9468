"""What the plugin's code must not do, whatever its size: call torch's private API. (The line caps
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
