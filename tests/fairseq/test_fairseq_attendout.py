"""AttendOut, scheduled attention dropout and attention LayerDrop through fairseq (task options)."""

import json
import re

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import (  # noqa: E402
    SENTENCE_PREDICTION_TOKENS,
    TINY_ROBERTA,
    TINY_TRANSFORMER,
    USER_DIR,
    fairseq_setup,
    fairseq_train,
    run_cli,
)

BASE = [
    "--task",
    "attn_reg_translation",
    *TINY_TRANSFORMER,
    "--criterion",
    "label_smoothed_cross_entropy",
    "--label-smoothing",
    "0.1",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--max-tokens",
    "500",
    "--cpu",
    "--seed",
    "1",
    "--no-progress-bar",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--no-epoch-checkpoints",
]
ATTENDOUT = ["--attendout", "--attendout-dropout-step", "3", "--attendout-attention", "encoder-self,decoder-self"]


def _updates(log: str):
    """{update: json stats} of fairseq's per-update train_inner lines."""
    out = {}
    for line in log.splitlines():
        if "| train_inner |" in line:
            stats = json.loads(line.split("| train_inner |", 1)[1])
            out[int(stats["num_updates"])] = stats
    return out


def test_attendout_trains_resumes_mid_dropout_step_identically_and_generates(tiny_mt_data, tmp_path):
    data = tiny_mt_data["bin"]
    common = [data, "--user-dir", USER_DIR, *BASE, *ATTENDOUT]
    full_log = tmp_path / "full.jsonl"
    full = run_cli(
        "fairseq-train",
        [*common, "--max-update", "10", "--save-dir", tmp_path / "full", "--attendout-log-file", full_log],
    )
    # Interrupted run: stop at update 5, in the middle of the second dropout step (updates 4-6).
    run_cli(
        "fairseq-train", [*common, "--max-update", "5", "--save-interval-updates", "5", "--save-dir", tmp_path / "cut"]
    )
    resumed = run_cli("fairseq-train", [*common, "--max-update", "10", "--save-dir", tmp_path / "cut"])
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 1 @ 5 updates\)", resumed.stdout)

    a, b = _updates(full.stdout), _updates(resumed.stdout)
    assert sorted(b) == [6, 7, 8, 9, 10]
    for u in b:  # Defender and Attacker losses continue exactly as without the interruption
        assert (a[u]["loss"], a[u]["attendout_attacker_loss"]) == (b[u]["loss"], b[u]["attendout_attacker_loss"]), u
    # The generator's mean drop probability per layer is in the training log ...
    assert {"attendout_p_encoder-self.0", "attendout_p_decoder-self.1"} <= set(a[1])
    # ... and in the file, one line per dropout step.
    records = [json.loads(line) for line in full_log.read_text().splitlines()]
    assert [r["update"] for r in records] == [3, 6, 9]
    assert set(records[0]["drop_prob"]) == {"encoder-self.0", "encoder-self.1", "decoder-self.0", "decoder-self.1"}
    assert all(0 < p < 1 for r in records for p in r["drop_prob"].values())
    assert re.search(r"AttendOut dropout step 3 \(update 9\): attacker win rate", full.stdout)

    # The saved model is a plain fairseq model: safe loading and fairseq-generate work on it.
    import attn_reg_plugin.fairseq_plugin  # noqa: F401

    state = torch.load(tmp_path / "full" / "checkpoint_last.pt", weights_only=True)
    assert "AttnRegTranslationTask" in state["extra_state"]
    gen = run_cli(
        "fairseq-generate",
        [
            data,
            "--user-dir",
            USER_DIR,
            "--path",
            tmp_path / "full" / "checkpoint_last.pt",
            "--required-batch-size-multiple",
            "1",
            "--cpu",
            "--beam",
            "2",
            "--max-len-b",
            "10",
        ],
    )
    assert len(re.findall(r"^D-\d+\t", gen.stdout, flags=re.M)) == 40


def test_attendout_sentence_prediction_resumes_mid_dropout_step_identically(tiny_sp_data, tmp_path):
    """The classifier wrapper: the Generator reads the sentence, held-out losses are per-sample CE."""
    common = [
        tiny_sp_data["cls"],
        "--user-dir",
        USER_DIR,
        "--task",
        "attn_reg_sentence_prediction",
        *TINY_ROBERTA,
        *SENTENCE_PREDICTION_TOKENS,
        "--criterion",
        "sentence_prediction",
        "--num-classes",
        "2",
        "--batch-size",
        "8",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--cpu",
        "--seed",
        "2",
        "--no-progress-bar",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--no-epoch-checkpoints",
        "--attendout",
        "--attendout-dropout-step",
        "2",
        "--attendout-max-positions",
        "256",
    ]
    full = run_cli("fairseq-train", [*common, "--max-update", "8", "--save-dir", tmp_path / "full"])
    run_cli(
        "fairseq-train", [*common, "--max-update", "3", "--save-interval-updates", "3", "--save-dir", tmp_path / "cut"]
    )
    resumed = run_cli("fairseq-train", [*common, "--max-update", "8", "--save-dir", tmp_path / "cut"])
    a, b = _updates(full.stdout), _updates(resumed.stdout)
    assert sorted(b) == [4, 5, 6, 7, 8]
    for u in b:
        assert (a[u]["loss"], a[u]["attendout_attacker_loss"]) == (b[u]["loss"], b[u]["attendout_attacker_loss"]), u
    assert "attendout_p_encoder-self.1" in a[1]
    assert re.search(r"AttendOut dropout step 4 \(update 8\)", full.stdout)


def _trainer(data_bin, extra):
    from fairseq.trainer import Trainer

    cfg, task, model, criterion = fairseq_setup(data_bin, [*BASE, *extra])
    task.load_dataset("train")
    task.load_dataset("valid")
    trainer = Trainer(cfg, task, model, criterion)
    itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
    return task, trainer, itr


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_defender_and_attacker_are_identical_at_each_dropout_step_start(tiny_mt_data):
    task, trainer, itr = _trainer(tiny_mt_data["bin"], ATTENDOUT)
    attendout = task.attn_reg_attendout
    snapshots = []
    original = None

    def spy(d_losses, a_losses, **kwargs):
        snapshots.append((_flat(trainer.model), _flat(attendout.attacker)))
        return original(d_losses, a_losses, **kwargs)

    batches = list(itr)
    trainer.train_step([batches[0]])
    original = attendout.game.finish_dropout_step
    attendout.game.finish_dropout_step = spy
    for batch in batches[1:7]:
        trainer.train_step([batch])
        if attendout.game.update_in_step == 0:  # a dropout step just ended and re-synced
            d, a = _flat(trainer.model), _flat(attendout.attacker)
            assert torch.equal(d, a)
            before_d, before_a = snapshots[-1]
            assert not torch.equal(before_d, before_a)  # they had diverged during the step
            assert torch.equal(d, before_d) or torch.equal(d, before_a)
    assert len(snapshots) == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--attendout", "--attendout-dropout-step", "0"], r"--attendout-dropout-step must be an integer >= 1, got 0"),
        (["--attendout", "--attendout-temperature", "0"], r"--attendout-temperature must be a finite number > 0"),
        (
            ["--attendout", "--attendout-init-drop", "1.2"],
            r"--attendout-init-drop must be in the open interval \(0, 1\)",
        ),
        (["--attendout", "--attendout-baseline-decay", "-0.5"], r"--attendout-baseline-decay must be in \[0, 1\)"),
        (
            ["--attendout", "--attendout-layers", "5"],
            r"--attendout-layers: layer 5 does not exist; .* accepted indices are 0\.\.1",
        ),
        (
            ["--attendout", "--attendout-clip-norm", "-1"],
            r"--attendout-clip-norm must be a finite number >= 0, got -1.0",
        ),
        (["--attn-layerdrop-p", "1.5"], r"--attn-layerdrop-p must be a probability in \[0, 1\], got 1\.5"),
        (
            ["--attn-layerdrop-p", "0.2", "--attn-layerdrop-layers", "2"],
            r"--attn-layerdrop-layers: layer 2 does not exist",
        ),
        (
            ["--attn-sched-dropout-schedule", "0:1.1"],
            r"--attn-sched-dropout-schedule: knot '0:1.1' probability must be a probability in \[0, 1\]",
        ),
        (
            ["--attn-sched-dropout-schedule", "0:0.5", "--attn-sched-dropout-attention", "cross"],
            r"unknown attention kind 'cross'",
        ),
        (
            ["--attendout", "--attn-layerdrop-p", "0.1"],
            r"^AttendOut \(--attendout\) and attention LayerDrop \(--attn-layerdrop-p\) do not combine in one run",
        ),
        # an option of a regularizer left off would do nothing (it trained plain, its layers unchecked)
        (
            ["--attn-drophead-layers", "0,7"],
            r"--attn-drophead-layers is '0,7', but --attn-drophead-schedule leaves its regularizer off, so it would "
            r"have no effect: turn it on with --attn-drophead-schedule, or leave --attn-drophead-layers out",
        ),
        (
            ["--attn-sched-dropout-attention", "decoder-self"],
            r"--attn-sched-dropout-schedule leaves its regularizer off",
        ),
        (["--attn-layerdrop-p", "0", "--attn-layerdrop-layers", "0"], r"--attn-layerdrop-p leaves its regularizer off"),
        (["--attendout-layers", "0"], r"--attendout-layers is '0', but --attendout leaves its regularizer off"),
        (["--attendout-valid-subset", "nosuch"], r"--attendout-valid-subset is 'nosuch', but --attendout leaves"),
    ],
)
def test_bad_task_options_fail_while_building(tiny_mt_data, extra, message):
    with pytest.raises(ValueError, match=message):
        fairseq_setup(tiny_mt_data["bin"], [*BASE, *extra])


def test_ad_drop_criterion_cannot_be_combined_with_a_task_regularizer(tiny_mt_data):
    args = [*BASE, "--attn-layerdrop-p", "0.1"]
    args[args.index("label_smoothed_cross_entropy")] = "ad_drop_label_smoothed_cross_entropy"
    message = (
        r"^AD-DROP \(--criterion ad_drop_label_smoothed_cross_entropy\) and attention LayerDrop \(--attn-layerdrop-p\) "
        "do not combine"
    )
    with pytest.raises(ValueError, match=message):
        fairseq_setup(tiny_mt_data["bin"], args)


@pytest.mark.parametrize(
    "extra,message,not_reached",
    [
        # a bad value: refused while the task is set up, before "begin training"
        (
            ["--attendout-temperature", "-1"],
            "--attendout-temperature must be a finite number > 0, got -1.0",
            "begin training",
        ),
        # a held-out split that does not exist: refused when training begins, before the first update
        (
            ["--attendout-valid-subset", "nosuch"],
            "--attendout-valid-subset 'nosuch' cannot be loaded: Dataset not found: nosuch",
            "num_updates",
        ),
    ],
)
def test_bad_attendout_option_stops_the_cli_before_training(tiny_mt_data, tmp_path, extra, message, not_reached):
    proc = fairseq_train(
        tiny_mt_data["bin"],
        [*BASE, "--attendout", *extra, "--save-dir", tmp_path],
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert message in proc.stdout
    assert not_reached not in proc.stdout and not list(tmp_path.glob("*.pt"))


def test_layerdrop_p1_makes_fairseq_encoder_attention_uniform(tiny_mt_data):
    _, task, model, _ = fairseq_setup(
        tiny_mt_data["bin"], [*BASE, "--attn-layerdrop-p", "1.0", "--attn-layerdrop-layers", "0"]
    )
    attn = model.encoder.layers[0].self_attn
    torch.manual_seed(0)
    x = torch.randn(5, 2, 16)  # (T, B, E)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with task.attn_reg_controller.hooks(task.attn_reg_active.get("layerdrop").hooks()):
        out, _ = attn(x, x, x, key_padding_mask=pad, need_weights=False)
    v = attn.v_proj(x)
    expected = torch.stack([v[:, 0].mean(0), v[:3, 1].mean(0)])  # mean of each sample's real values
    assert torch.allclose(out, attn.out_proj(expected).unsqueeze(0).expand(5, 2, 16), atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        [
            "--attn-sched-dropout-schedule",
            "0:0.6,20:0.1|0:0.3,20:0.3",
            "--attn-sched-dropout-attention",
            "encoder-self",
        ],
        ["--attn-layerdrop-p", "0.5", "--attn-layerdrop-attention", "encoder-self,decoder-self"],
    ],
)
def test_no_extra_cost_regularizers_train_and_change_the_training_loss_only(tiny_mt_data, extra):
    """Same seed: the regularized run's training losses differ, its plain validation works."""
    losses = {}
    for name, args in (("plain", []), ("regularized", extra)):
        task, trainer, itr = _trainer(tiny_mt_data["bin"], args)
        log = [trainer.train_step([batch]) for batch, _ in zip(itr, range(3))]
        losses[name] = [float(x["loss"]) for x in log]
        assert all(torch.isfinite(torch.tensor(losses[name])))
    assert losses["plain"] != losses["regularized"]


def test_dropkey_preset_logs_each_layers_depth_rate(tiny_mt_data):
    """--attn-sched-dropout-schedule dropkey:0.4 on the 2-layer encoder and decoder: layer 0 at 0.4,
    layer 1 at 0.2 in every kind, logged each update; the kernel's rate between the two."""
    extra = [
        "--attn-sched-dropout-schedule",
        "dropkey:0.4",
        "--attn-sched-dropout-attention",
        "encoder-self,decoder-self",
    ]
    task, trainer, itr = _trainer(tiny_mt_data["bin"], extra)
    assert task.attn_reg_active.get("scheduled_dropout").probabilities(0) == pytest.approx({0: 0.4, 1: 0.2})
    for batch, _ in zip(itr, range(2)):
        log = trainer.train_step([batch])
        assert torch.isfinite(torch.tensor(float(log["loss"])))
        assert (log["attn_sched_dropout_p_layer0"], log["attn_sched_dropout_p_layer1"]) == (0.4, 0.2)
        assert 0.2 < log["attn_sched_dropout_rate"] < 0.4, log


def test_attendout_on_a_fairseq_without_task_checkpoint_state_says_so(monkeypatch):
    """fairseq 0.12.2 saves no task state: --attendout must refuse rather than lose the game on resume."""
    from attn_reg_plugin.fairseq_plugin import attendout_checkpoint as attendout

    attendout.check_fairseq_supports_task_state()  # the installed fairseq-fixed has it
    # 0.12.2's checkpoint_utils never asks the task for its state.
    monkeypatch.setattr(
        attendout, "_checkpoint_utils_source", lambda: "def save_checkpoint(cfg, trainer, epoch_itr, val_loss): ..."
    )
    with pytest.raises(RuntimeError, match=r"--attendout needs a fairseq whose checkpoints carry task state"):
        attendout.check_fairseq_supports_task_state()
