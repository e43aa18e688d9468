"""core.combinations: the one table of regularizers that combine, and its refusals; the schedule options'
type check; the shims removed; the torch version the core needs."""

import subprocess
import sys

import pytest

from attn_reg_plugin.core.regularizers.combinations import (
    AD_DROP,
    ATTENDOUT,
    COMBINATIONS,
    RDROP,
    check_combination,
    combinations_table,
)
from attn_reg_plugin.core.regularizers.drophead import DropHeadConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import DROPKEY_REGULARIZER as DROPKEY
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it


def test_a_combination_in_the_table_passes_and_any_other_pair_is_refused_naming_both():
    check_combination({AD_DROP: "--criterion x", RDROP: "--criterion x"})
    check_combination({ATTENDOUT: "--attendout"})
    check_combination({})
    with pytest.raises(ValueError) as e:
        check_combination({ATTENDOUT: "--attendout", DROPKEY: "--attn-sched-dropout-schedule"})
    message = str(e.value)
    assert message.startswith(
        "AttendOut (--attendout) and DropKey (--attn-sched-dropout-schedule) do not combine in one run"
    )
    assert "AD-DROP + R-Drop (`--criterion ad_drop_rdrop_label_smoothed_cross_entropy` in fairseq" in message
    # A combination of the table plus a third regularizer is not in the table.
    with pytest.raises(ValueError, match=r"AD-DROP \+ R-Drop \(--criterion c\) and AttendOut \(--attendout\) do not"):
        check_combination({AD_DROP: "--criterion c", RDROP: "--criterion c", ATTENDOUT: "--attendout"})


def test_docs_options_prints_the_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "OPTIONS.md").read_text(encoding="utf-8")
    assert "<!-- combinations -->\n" + combinations_table() + "\n" in text
    assert len(COMBINATIONS) == len(combinations_table().splitlines()) - 2


@pytest.mark.parametrize("config", [DropHeadConfig, ScheduledDropoutConfig])
@pytest.mark.parametrize("value", [0.1, 3, None])
def test_a_schedule_that_is_no_string_is_refused_naming_the_option(config, value):
    prefix = config.FLAG_PREFIX
    with pytest.raises(ValueError, match=rf"^{prefix}schedule must be a string, .* got {value!r} \("):
        config(schedule=value).validate()


def test_the_removed_shims_are_gone():
    from attn_reg_plugin.core.kernel.attention_call import Record
    from attn_reg_plugin.core.kernel.controller import RegularizationController
    from attn_reg_plugin.hf.attendout_trainer import AttendOutTrainerMixin

    assert not hasattr(RegularizationController, "training_step")
    assert not hasattr(Record, "weights")
    assert not hasattr(AttendOutTrainerMixin, "attendout_log")
    import attn_reg_plugin.core.regularizers.ad_drop as ad_drop

    assert not hasattr(ad_drop, "StepCounts")  # the stats are a plain dict: stats["valid"] is a KeyError


def test_the_core_names_the_torch_it_needs_when_imported_on_an_older_one():
    """torch < 2.4 has no torch.library.custom_op: the import says so instead of an AttributeError."""
    code = "import torch; del torch.library.custom_op; import attn_reg_plugin.core"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "ImportError: attn_reg_plugin needs torch >= 2.4 (torch.library.custom_op)" in done.stderr


def test_the_package_declares_that_torch():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dependencies = ["torch>=2.4"]' in text
