"""What AttendOut does with each of fairseq's resume flags (docs/CHECKPOINTS.md, "AttendOut and fairseq's --reset-* flags").

One uninterrupted fairseq-train run of 6 updates (dropout step T = 3) also writes its checkpoint at
update 4, in the middle of the second dropout step (the Attacker differs from the Defender, one
update is cached). Each test resumes that checkpoint with some of fairseq's ``--reset-*`` flags.
"""

import re
import shutil

import pytest
import torch

pytest.importorskip("fairseq")

from test_fairseq_attendout import ATTENDOUT, BASE, _trainer, _updates  # noqa: E402

from helpers import fairseq_train  # noqa: E402

# The set-up: Adam with betas 0.9/0.98 and no weight decay before the resume.
TRAIN = [*BASE, *ATTENDOUT, "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_mt_data, tmp_path_factory):
    """The 6-update run: its log, and its checkpoint of update 4."""
    save = tmp_path_factory.mktemp("attendout_uninterrupted")
    proc = fairseq_train(
        tiny_mt_data["bin"],
        [*TRAIN, "--max-update", "6", "--save-interval-updates", "4"] + ["--save-dir", save],
    )
    return {"log": _updates(proc.stdout), "stdout": proc.stdout, "checkpoint": save / "checkpoint_1_4.pt"}


def _resume(tiny_mt_data, uninterrupted, tmp_path, *flags):
    """fairseq-train resumed from update 4's checkpoint (as its save dir's checkpoint_last.pt)."""
    save = tmp_path / "resumed"
    save.mkdir()
    shutil.copy(uninterrupted["checkpoint"], save / "checkpoint_last.pt")
    proc = fairseq_train(tiny_mt_data["bin"], [*TRAIN, *flags, "--save-dir", save])
    import attn_reg_plugin.fairseq_plugin  # noqa: F401  (safe loading of fairseq checkpoints)

    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    return proc.stdout, state


def _groups(optimizer_state):
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer_state["param_groups"]]


def _steps(optimizer_state):
    return {int(s["step"]) for s in optimizer_state["state"].values()}


def _attendout(state):
    return state["extra_state"]["AttnRegTranslationTask"]["attendout"]


RESTORED = r"AttendOut: restored the Attacker, .*the Generator.*, the baseline and the unfinished dropout step"


def test_reset_optimizer_resets_the_attackers_optimizer_and_it_takes_the_defenders_new_settings(
    tiny_mt_data, uninterrupted, tmp_path
):
    """--reset-optimizer: both networks' optimizers start afresh, with the resumed command's
    settings; the rest of the game (Attacker weights, Generator, baseline, dropout step) is kept.
    fairseq also restarts its update count (and --max-update) at 0 with this flag."""
    stdout, state = _resume(
        tiny_mt_data,
        uninterrupted,
        tmp_path,
        "--reset-optimizer",
        "--weight-decay",
        "0.1",
        "--adam-betas",
        "(0.5, 0.9)",
        "--max-update",
        "1",
    )
    assert re.search(RESTORED + r".*the Attacker's optimizer is reset \(--reset-optimizer\)", stdout)
    defender, attacker = state["last_optimizer_state"], _attendout(state)["attacker_optimizer"]
    assert _groups(attacker) == _groups(defender)
    assert tuple(_groups(attacker)[0]["betas"]) == (0.5, 0.9) and _groups(attacker)[0]["weight_decay"] == 0.1
    # Fresh Adam moments on both sides: one step since the resume (the old Attacker had taken 4).
    assert _steps(defender) == _steps(attacker) == {1}
    game = _attendout(state)["game"]
    assert (game["dropout_steps_done"], game["update_in_step"]) == (1, 2)  # update 4's step went on


def test_reset_dataloader_keeps_the_game(tiny_mt_data, uninterrupted, tmp_path):
    """--reset-dataloader: fairseq does not hand the task its checkpoint state then; AttendOut reads it
    from the checkpoint itself and continues the dropout step (which ends at update 6, not 7)."""
    stdout, state = _resume(tiny_mt_data, uninterrupted, tmp_path, "--reset-dataloader", "--max-update", "6")
    read = r"from \S*checkpoint_last\.pt, read by AttendOut \(fairseq hands the task no checkpoint state with --reset-dataloader\)"
    assert re.search(RESTORED + r".*" + read, stdout)
    assert sorted(_updates(stdout)) == [5, 6]  # the data starts over, the update count does not
    assert re.search(r"AttendOut dropout step 2 \(update 6\)", stdout)
    game = _attendout(state)["game"]
    assert (game["dropout_steps_done"], game["update_in_step"]) == (2, 0)
    # The restored Attacker optimizer went on from its 4 steps, as the Defender's did.
    assert _steps(state["last_optimizer_state"]) == _steps(_attendout(state)["attacker_optimizer"]) == {6}


def test_reset_meters_changes_nothing_in_the_game(tiny_mt_data, uninterrupted, tmp_path):
    """--reset-meters: only fairseq's logged averages restart; both networks' losses continue exactly."""
    stdout, _ = _resume(tiny_mt_data, uninterrupted, tmp_path, "--reset-meters", "--max-update", "6")
    assert re.search(RESTORED, stdout) and "reset" not in re.search(RESTORED + ".*", stdout).group(0)
    a, b = uninterrupted["log"], _updates(stdout)
    assert sorted(b) == [5, 6]
    for u in b:
        assert (a[u]["loss"], a[u]["attendout_attacker_loss"]) == (b[u]["loss"], b[u]["attendout_attacker_loss"]), u


def test_reset_lr_scheduler_attacker_follows_the_defenders_new_schedule(tiny_mt_data, uninterrupted, tmp_path):
    """--reset-lr-scheduler (here switching to a warm-up): the Attacker's learning rate is the Defender's
    at every step; its optimizer state and the game are restored."""
    stdout, state = _resume(
        tiny_mt_data,
        uninterrupted,
        tmp_path,
        "--reset-lr-scheduler",
        "--lr-scheduler",
        "inverse_sqrt",
        "--warmup-updates",
        "10",
        "--warmup-init-lr",
        "1e-4",
        "--max-update",
        "6",
    )
    assert re.search(RESTORED, stdout)
    log = _updates(stdout)
    assert log[5]["lr"] != log[6]["lr"]  # warming up
    defender, attacker = state["last_optimizer_state"], _attendout(state)["attacker_optimizer"]
    assert _groups(attacker) == _groups(defender)
    assert _steps(defender) == _steps(attacker) == {6}
    assert re.search(r"AttendOut dropout step 2 \(update 6\)", stdout)


def test_attacker_takes_the_defenders_param_groups_at_every_step_and_after_every_re_sync(tiny_mt_data):
    """In process: D's settings changed during a dropout step, and again just before its re-sync."""
    task, trainer, itr = _trainer(tiny_mt_data["bin"], ATTENDOUT)
    attendout, batches = task.attn_reg_attendout, list(itr)

    def settings(optimizer):
        return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def change(optimizer, **values):
        for group in optimizer.param_groups:
            group.update(values)

    trainer.train_step([batches[0]])
    change(trainer.optimizer, betas=(0.5, 0.9), weight_decay=0.1)
    trainer.train_step([batches[1]])
    assert settings(attendout.attacker_optimizer) == settings(trainer.optimizer)
    original = attendout.game.finish_dropout_step

    def change_then_finish(*args, **kwargs):  # after A's step of update 3, before the re-sync
        change(trainer.optimizer, eps=1e-6, betas=(0.8, 0.95))
        return original(*args, **kwargs)

    attendout.game.finish_dropout_step = change_then_finish
    trainer.train_step([batches[2]])
    assert attendout.game.dropout_steps_done == 1
    assert settings(attendout.attacker_optimizer) == settings(trainer.optimizer)
    assert settings(attendout.attacker_optimizer)[0]["eps"] == 1e-6
