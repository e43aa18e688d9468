"""A regularizer that will not act in the planned run is told before training (core.planned_run),
and AttendOut's generator is sized to the model unless max_positions is set."""

import pytest
import torch

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig, first_ad_drop_epoch
from attn_reg_plugin.core.regularizers.attendout import AttendOut, AttendOutConfig, Generator
from attn_reg_plugin.core.regularizers.attendout.config import DEFAULT_MAX_POSITIONS, generator_positions
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.options import named_by_field
from attn_reg_plugin.core.regularizers.planned_run import idle_run_warning
from attn_reg_plugin.core.regularizers.scheduled_dropout import (
    ScheduledDropoutConfig,
    first_dropping_update,
    parse_schedules,
)
from helpers import controller_with_sites

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it


def test_first_ad_drop_epoch():
    assert first_ad_drop_epoch("cross-tuning", 1) is None  # paper Alg. 1: epoch 1 is plain
    assert first_ad_drop_epoch("cross-tuning", 2) == 2
    assert first_ad_drop_epoch("cross-tuning", 10**18) == 2  # an unbounded plan costs nothing
    assert first_ad_drop_epoch("always", 1) == 1
    with pytest.raises(ValueError, match="schedule"):
        first_ad_drop_epoch("never", 3)


def test_one_epoch_of_cross_tuning_warns_naming_schedule_epochs_and_the_fix():
    flag = idle_run_warning(ADDropConfig(), 1, 12, "--max-epoch 1, 12 updates per epoch")
    assert "--ad-drop-schedule cross-tuning is plain in epoch 1" in flag
    assert "this run plans 1 epoch (--max-epoch 1, 12 updates per epoch): AD-DROP will never act" in flag
    assert "Set --ad-drop-schedule always" in flag and "a warning, not an error" in flag
    python = idle_run_warning(named_by_field(ADDropConfig()), 1, 5, "TrainingArguments.max_steps=5")
    assert 'ADDropConfig(schedule="cross-tuning")' in python and 'Set ADDropConfig(schedule="always")' in python
    # silent: two epochs, schedule always, an unknown plan
    assert idle_run_warning(ADDropConfig(), 2, 24, "") is None
    assert idle_run_warning(ADDropConfig(schedule="always"), 1, 12, "") is None
    assert idle_run_warning(ADDropConfig(), None, 12, "") is None


def test_attendout_with_fewer_updates_than_one_dropout_step_warns():
    message = idle_run_warning(AttendOutConfig(dropout_step=20), 3, 6, "--max-update 6")
    assert "every --attendout-dropout-step 20 updates, and this run plans 6 updates (--max-update 6)" in message
    assert "Lower --attendout-dropout-step to at most 6" in message
    assert idle_run_warning(AttendOutConfig(dropout_step=6), 1, 6, "") is None
    assert idle_run_warning(AttendOutConfig(), None, None, "") is None


def test_scheduled_dropout_at_zero_over_the_whole_run_warns():
    assert first_dropping_update(parse_schedules("0:0,10:0.5", "s"), 20) == 1  # linear: above 0 right after 0
    assert first_dropping_update(parse_schedules("0:0,5:0,6:0.5", "s"), 6) is None
    assert first_dropping_update(parse_schedules("0:0,5:0,6:0.5", "s"), 7) == 6
    assert first_dropping_update(parse_schedules("0:0.1|0:0,4:0", "s"), 3) == 0  # one layer of two is enough
    config = ScheduledDropoutConfig(schedule="0:0,100:0,200:0.3")
    message = idle_run_warning(config, 1, 50, "--max-update 50")
    assert "--attn-sched-dropout-schedule 0:0,100:0,200:0.3 is 0 at every one of the 50 updates" in message
    assert idle_run_warning(config, 1, 150, "") is None
    assert idle_run_warning(AttentionLayerDropConfig(p=0.2), 1, 1, "") is None  # no schedule: it always acts


def test_generator_positions_default_to_the_models_maximum_length():
    assert AttendOutConfig().max_positions is None
    AttendOutConfig().validate()  # unset is valid
    assert generator_positions(AttendOutConfig(), 8192) == 8192
    assert generator_positions(AttendOutConfig(), None) == DEFAULT_MAX_POSITIONS == 1024  # T5: no stated maximum
    assert generator_positions(AttendOutConfig(max_positions=512), 8192) == 512  # explicit: checked per batch
    with pytest.raises(ValueError, match="--attendout-max-positions must be an integer >= 1, got 0"):
        AttendOutConfig(max_positions=0).validate()


def test_a_batch_longer_than_the_generator_names_the_option_and_the_length_to_set():
    generator = Generator({"source": 10}, {"source": 1}, 4, 3, 0.2, 1.0)
    with pytest.raises(
        ValueError, match=r"longer than the generator's 3 positions; set --attendout-max-positions to at least 5"
    ):
        generator.policies({"source": torch.full((1, 5), 2)}, controller_with_sites({"encoder-self": 1}).sites)


def test_resuming_a_game_whose_generator_has_other_positions_names_the_option():
    def game(positions):
        return AttendOut(
            AttendOutConfig(dropout_step=2),
            controller_with_sites({"encoder-self": 1}),
            Generator({"source": 10}, {"source": 1}, 4, positions, 0.2, 1.0),
        )

    saved = game(1024).state_dict()  # a run before max_positions was sized to the model
    with pytest.raises(
        ValueError, match="generator has 1024 positions, this run's 512: set --attendout-max-positions to 1024"
    ):
        game(512).load_state_dict(saved)


def test_a_generator_sized_to_a_huge_model_length_warns_naming_the_option(caplog):
    """Unset, max_positions follows the model: at 131,072 positions (Llama 3.1) the position table
    alone is about 100 MiB in memory and in each checkpoint, which the user is told, with the fix."""
    with caplog.at_level("WARNING"):
        assert generator_positions(named_by_field(AttendOutConfig()), 131072) == 131072
    assert "AttendOutConfig.max_positions is unset" in caplog.text and "131072 positions" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        generator_positions(AttendOutConfig(), 8192)
        generator_positions(AttendOutConfig(max_positions=512), 131072)
    assert caplog.text == ""
