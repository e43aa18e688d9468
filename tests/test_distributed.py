"""Distributed training on CPU (gloo, 2 processes): the ranks stay in sync with AD-DROP.

fairseq: ``fairseq-train`` (through tests/fairseq_rank.py, which adds per-rank parameter
dumps and lets ``pytorch_ddp`` wrap a CPU module) with ``--distributed-world-size 2`` under
``--ddp-backend pytorch_ddp`` (with and without ``--find-unused-parameters``) and
``legacy_ddp``, for AD-DROP and for AttendOut; after a plain and an AD-DROP epoch both ranks hold the same parameters, and
the logged AD-DROP flag and drop rate are those of the whole job; a slow test resumes a
2-rank run from checkpoint_last (rank 0 reads it, the others receive it).
HF: ``torchrun --nproc_per_node 2`` of ADDropTrainer on a tiny BERT. R-Drop's two forwards under
``pytorch_ddp`` without ``--find-unused-parameters`` (its HF run: tests/hf/test_hf_rdrop.py), and
DropHead and DropKey the same way, each with rank 0's TensorBoard events checked against its JSON log.
"""

import re

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import (  # noqa: E402
    TRAIN_ARGS,
    USER_DIR,
    free_port,
    rank_processes,
    tensorboard_scalars,
    torchrun_ranks,
    train_updates,
)

WORLD = 2
UPDATES_PER_EPOCH = 6  # 12 batches of the tiny corpus shared by 2 ranks


def _fairseq_ranks(data_bin, save, extra, max_epoch, regularizer="ad_drop", timeout=300):
    """Start every rank, wait for all; return rank 0's log (the other ranks log warnings only)."""
    port = free_port()
    rank_args = [
        [
            data_bin,
            "--user-dir",
            USER_DIR,
            "--save-dir",
            save,
            *TRAIN_ARGS[regularizer],
            "--max-epoch",
            max_epoch,
            "--distributed-world-size",
            WORLD,
            "--distributed-rank",
            rank,
            "--distributed-no-spawn",
            "--distributed-init-method",
            f"tcp://127.0.0.1:{port}",
            "--distributed-backend",
            "gloo",
            *extra,
        ]  # fmt: skip
        for rank in range(WORLD)
    ]
    ranks = rank_processes("fairseq_rank.py", rank_args, timeout)
    for rank, (_, text) in enumerate(ranks):  # every rank's log, before any is judged
        (save.parent / f"{save.name}-rank{rank}-epoch{max_epoch}.log").write_text(text)
    for rank, (code, text) in enumerate(ranks):
        assert code == 0, f"rank {rank} failed ({code}):\n{text[-4000:]}"
    return ranks[0][1]


def _same_parameters_on_every_rank(save, update):
    dumps = [torch.load(save / f"params-rank{r}-update{update}.pt") for r in range(WORLD)]
    for r in range(1, WORLD):
        assert dumps[r].keys() == dumps[0].keys()
        different = [k for k in dumps[0] if not torch.equal(dumps[0][k], dumps[r][k])]
        assert not different, f"rank {r} differs from rank 0 after {update} updates in {different[:5]}"
    return dumps[0]


def _check_ad_drop_epoch(updates, epoch):
    rows = [updates[u] for u in sorted(updates) if updates[u]["epoch"] == epoch]
    assert len(rows) == UPDATES_PER_EPOCH
    for row in rows:
        # Both workers' logs are summed by fairseq: the flag is still 1, the rate about p*q = 0.15.
        assert row["ad_drop_on"] == "1" and 0.1 < float(row["ad_drop_rate"]) < 0.25, row
        assert int(row["bsz"]) > 0


def _check_plain_epoch(updates, epoch):
    rows = [updates[u] for u in sorted(updates) if updates[u]["epoch"] == epoch]
    assert len(rows) == UPDATES_PER_EPOCH and all(r["ad_drop_on"] == "0" and r["ad_drop_rate"] == "0" for r in rows)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--ddp-backend", "pytorch_ddp"], id="pytorch_ddp"),
        pytest.param(
            ["--ddp-backend", "pytorch_ddp", "--find-unused-parameters"],
            id="pytorch_ddp-find-unused-parameters",
            marks=pytest.mark.slow,
        ),
        pytest.param(["--ddp-backend", "legacy_ddp"], id="legacy_ddp", marks=pytest.mark.slow),
    ],
)
def test_fairseq_two_ranks_stay_in_sync(tiny_mt_data, tmp_path, extra):
    save = tmp_path / "ckpt"
    updates = train_updates(_fairseq_ranks(tiny_mt_data["bin"], save, extra, max_epoch=2))
    _check_plain_epoch(updates, 1)
    _check_ad_drop_epoch(updates, 2)
    first = _same_parameters_on_every_rank(save, UPDATES_PER_EPOCH)
    last = _same_parameters_on_every_rank(save, 2 * UPDATES_PER_EPOCH)
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the AD-DROP epoch trained


@pytest.mark.slow
def test_fairseq_two_ranks_resume_into_an_ad_drop_epoch(tiny_mt_data, tmp_path):
    """Rank 0 reads checkpoint_last and sends it to rank 1 (through the safe-load allow-list)."""
    save = tmp_path / "ckpt"
    _check_plain_epoch(train_updates(_fairseq_ranks(tiny_mt_data["bin"], save, [], max_epoch=1)), 1)
    _same_parameters_on_every_rank(save, UPDATES_PER_EPOCH)
    log = _fairseq_ranks(tiny_mt_data["bin"], save, [], max_epoch=2)
    assert re.search(rf"Loaded checkpoint \S+checkpoint_last\.pt \(epoch 2 @ {UPDATES_PER_EPOCH} updates\)", log)
    _check_ad_drop_epoch(train_updates(log), 2)
    _same_parameters_on_every_rank(save, 2 * UPDATES_PER_EPOCH)


@pytest.mark.slow
def test_hf_trainer_torchrun_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    ranks = torchrun_ranks("hf_rank.py", tmp_path, world=WORLD, timeout=300)
    assert all(r["world_size"] == WORLD for r in ranks)
    params = [r["params"] for r in ranks]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    logs = [h for h in ranks[0]["log_history"] if "loss" in h]
    assert [h["ad_drop_on"] for h in logs] == [0] * 4 + [1] * 4  # 48 rows / (6 x 2 ranks) = 4 steps per epoch
    # The logged rate is the whole job's: both ranks' counts summed (each rank recorded its own).
    local = [r["local_counts"] for r in ranks]
    assert len(local[0]) == len(local[1]) == len(logs)
    for h, (d0, v0), (d1, v1) in zip(logs, *local):
        assert h["ad_drop_rate"] == (round((d0 + d1) / (v0 + v1), 6) if v0 + v1 else 0.0)
    assert any(v0 and round(d0 / v0, 6) != h["ad_drop_rate"] for h, (d0, v0) in zip(logs, local[0]))


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--ddp-backend", "legacy_ddp"], id="legacy_ddp"),
        pytest.param(["--ddp-backend", "pytorch_ddp"], id="pytorch_ddp"),
        pytest.param(
            ["--ddp-backend", "pytorch_ddp", "--find-unused-parameters"],
            id="pytorch_ddp-find-unused-parameters",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_fairseq_two_ranks_attendout_stay_in_sync(tiny_mt_data, tmp_path, extra):
    """AttendOut over 2 gloo ranks: the Attacker's and Generator's gradients are all-reduced and
    every rank draws the same held-out samples and survivor, so the saved Defenders agree."""
    save = tmp_path / "ckpt"
    log = _fairseq_ranks(tiny_mt_data["bin"], save, extra, max_epoch=1, regularizer="attendout")
    updates = train_updates(log)
    assert len(updates) == UPDATES_PER_EPOCH and all("attendout_attacker_loss" in r for r in updates.values())
    assert "AttendOut dropout step 1 (update 4)" in log
    _same_parameters_on_every_rank(save, UPDATES_PER_EPOCH)


def test_fairseq_two_ranks_drophead_without_find_unused_parameters(tiny_mt_data, tmp_path):
    """DropHead through torch's DDP (pytorch_ddp, find_unused_parameters off): a dropped head's
    projections still get a (zero) gradient in the one backward, so every gradient is reduced, the
    ranks stay identical, and the rate summed over both ranks is logged at every update."""
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    extra = ["--ddp-backend", "pytorch_ddp", "--tensorboard-logdir", str(tb)]  # rank 0 writes it
    updates = train_updates(_fairseq_ranks(tiny_mt_data["bin"], save, extra, max_epoch=1, regularizer="drophead"))
    assert sorted(updates) == list(range(1, UPDATES_PER_EPOCH + 1))
    assert all(0.1 < float(r["attn_drophead_rate"]) < 0.5 for r in updates.values()), updates
    _same_parameters_on_every_rank(save, UPDATES_PER_EPOCH)
    _tensorboard_has_the_json_log(tb, updates, ["attn_drophead_rate", "attn_drophead_p"])


def test_fairseq_two_ranks_dropkey_without_find_unused_parameters(tiny_mt_data, tmp_path):
    """DropKey (the scheduled-dropout preset dropkey:0.4) through torch's DDP, find_unused_parameters
    off: layer 0 drops at 0.4 and layer 1 at 0.2 on both ranks, the rate the kernels counted on both
    ranks lies between, the ranks stay identical, and TensorBoard holds what the JSON log holds."""
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    extra = ["--ddp-backend", "pytorch_ddp", "--tensorboard-logdir", str(tb)]
    updates = train_updates(_fairseq_ranks(tiny_mt_data["bin"], save, extra, max_epoch=1, regularizer="dropkey"))
    assert sorted(updates) == list(range(1, UPDATES_PER_EPOCH + 1))
    for r in updates.values():
        assert (float(r["attn_sched_dropout_p_layer0"]), float(r["attn_sched_dropout_p_layer1"])) == (0.4, 0.2)
        assert 0.2 < float(r["attn_sched_dropout_rate"]) < 0.4, r
    _same_parameters_on_every_rank(save, UPDATES_PER_EPOCH)
    keys = ["attn_sched_dropout_rate", "attn_sched_dropout_p_layer0", "attn_sched_dropout_p_layer1"]
    _tensorboard_has_the_json_log(tb, updates, keys)


def _tensorboard_has_the_json_log(tb, updates, keys):
    """Rank 0's TensorBoard events hold each key's per-update values of the JSON log (float32)."""
    scalars = tensorboard_scalars(tb)["train_inner"]
    for key in keys:
        assert scalars[key] == pytest.approx({u: float(r[key]) for u, r in updates.items()}, abs=1e-6), key


def test_fairseq_two_ranks_rdrop_without_find_unused_parameters(tiny_mt_data, tmp_path):
    """R-Drop's two forwards through torch's DDP (pytorch_ddp, find_unused_parameters off): one backward
    reduces every gradient once, the ranks stay identical, and rdrop_kl is logged at every update."""
    save = tmp_path / "ckpt"
    log = _fairseq_ranks(tiny_mt_data["bin"], save, ["--ddp-backend", "pytorch_ddp"], max_epoch=1, regularizer="rdrop")
    updates = train_updates(log)
    assert sorted(updates) == list(range(1, UPDATES_PER_EPOCH + 1))
    assert all(float(r["rdrop_kl"]) > 0 for r in updates.values())
    _same_parameters_on_every_rank(save, UPDATES_PER_EPOCH)
