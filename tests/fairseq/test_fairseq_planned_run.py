"""fairseq-train says before the first update when its regularizer will not act in the planned run
(issue 40 item 3), and AttendOut's generator covers the model's positions unless
--attendout-max-positions is set (item 4)."""

import re

import pytest

pytest.importorskip("fairseq")

from helpers import LOGGED_TRAIN, TINY_TRANSFORMER, fairseq_setup, fairseq_train  # noqa: E402


def _warning_before_the_first_update(log: str) -> str:
    """The plugin's one WARNING line about the planned run, checked to come before any update."""
    warnings = [m for m in re.finditer(r"(?m)^.*\| WARNING \| .*will never act.*$", log)]
    assert len(warnings) == 1, log[-3000:]
    first_update = log.index("| train_inner |")
    assert warnings[0].start() < first_update
    return warnings[0].group(0)


@pytest.mark.parametrize(
    "limits,plan",
    [
        (["--max-epoch", "1"], "this run plans 1 epoch (--max-epoch 1, 12 updates per epoch)"),
        (
            ["--max-epoch", "5", "--max-update", "3"],
            "plans 1 epoch (--max-epoch 5, --max-update 3, 12 updates per epoch)",
        ),
    ],
)
def test_cross_tuning_that_ends_in_epoch_1_warns_before_the_first_update(tiny_mt_data, tmp_path, limits, plan):
    # LOGGED_TRAIN plans 2 epochs (--max-epoch 2): the last value of a repeated flag counts
    proc = fairseq_train(tiny_mt_data["bin"], ["--save-dir", tmp_path, "--no-save", *LOGGED_TRAIN["ad_drop"], *limits])
    line = _warning_before_the_first_update(proc.stdout)
    assert "--ad-drop-schedule cross-tuning is plain in epoch 1" in line
    assert f"{plan}: AD-DROP will never act" in line
    assert "Set --ad-drop-schedule always" in line


def test_attendout_generator_covers_the_models_positions_unless_set(tiny_mt_data):
    """Before: 1,024 generator positions whatever --max-source/target-positions allowed."""
    base = [
        "--task", "attn_reg_translation", *TINY_TRANSFORMER, "--criterion", "label_smoothed_cross_entropy",
        "--attendout", "--max-source-positions", "1100", "--max-target-positions", "1300",
    ]  # fmt: skip
    _, task, _, _ = fairseq_setup(tiny_mt_data["bin"], base)
    assert task.attn_reg_attendout.config.max_positions == 1300
    _, task, _, _ = fairseq_setup(tiny_mt_data["bin"], [*base, "--attendout-max-positions", "256"])
    assert task.attn_reg_attendout.config.max_positions == 256
