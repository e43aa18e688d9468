"""What a fairseq-train run logs: each regularizer's keys in the JSON log and in TensorBoard, with
values the kernel measured; the cross-tuning phase per epoch; no start-up warnings; --eval-bleu."""

import json
import re

import pytest

pytest.importorskip("fairseq")
pytest.importorskip("tensorboardX")

from helpers import (  # noqa: E402
    LAYERDROP_P,
    LOGGED_TRAIN,
    TINY_TRANSFORMER,
    WARNING_LINE,
    fairseq_train,
    tensorboard_scalars,
    train_epochs_json,
)

UPDATES_PER_EPOCH = 12


def scheduled_p(update_num):
    """helpers.SCHED_DROPOUT_SCHEDULE at fairseq's 0-based update_num: 0.1 at 0, 0.5 at 24."""
    return 0.1 + 0.4 * min(update_num, 24) / 24


def logged(run, keys):
    """{key: ({update: value}, {epoch: value})} from the JSON log, checked equal to the TensorBoard events."""
    tb = tensorboard_scalars(run["tb"])
    epochs = train_epochs_json(run["log"])
    assert sorted(epochs) == [1, 2]
    out = {}
    for key in keys:
        per_update = {u: float(r[key]) for u, r in run["updates"].items()}
        per_epoch = {e: float(r[key]) for e, r in epochs.items()}
        assert sorted(per_update) == list(range(1, 2 * UPDATES_PER_EPOCH + 1)), key
        # TensorBoard holds the same numbers (float32), per update and at each epoch's last update.
        assert tb["train_inner"][key] == pytest.approx(per_update, abs=1e-6), key
        assert tb["train"][key] == pytest.approx({e * UPDATES_PER_EPOCH: v for e, v in per_epoch.items()}, abs=1e-6)
        out[key] = (per_update, per_epoch)
    return out


def test_ad_drop_keys_and_the_phase_of_each_epoch(logged_runs):
    run = logged_runs("ad_drop")
    values = logged(run, ["ad_drop_on", "ad_drop_rate", "ad_drop_skipped"])
    on, rate = values["ad_drop_on"], values["ad_drop_rate"]
    assert on[1] == {1: 0.0, 2: 1.0}  # epoch 1 plain, epoch 2 AD-DROP (cross-tuning)
    assert all(on[0][u] == (u > UPDATES_PER_EPOCH) for u in on[0])
    p, q = 0.3, 0.5
    assert rate[1][1] == 0 and 0.5 * p * q < rate[1][2] < 2.5 * p * q  # about p*q (ceil(p*n) inflates short rows)
    assert all(rate[0][u] == 0 for u in range(1, UPDATES_PER_EPOCH + 1))
    assert all(0.5 * p * q < rate[0][u] < 2.5 * p * q for u in range(UPDATES_PER_EPOCH + 1, 25))
    assert values["ad_drop_skipped"][1] == {1: 0, 2: 0}
    # One line per epoch names its phase, before the epoch's updates.
    phases = re.findall(r"attn_reg_task \| (epoch \d+: [\w-]+)", run["log"])
    assert phases == ["epoch 1: plain", "epoch 2: AD-DROP"]


def test_scheduled_dropout_rate_follows_the_schedule(logged_runs):
    run = logged_runs("sched_dropout")
    values = logged(run, ["attn_sched_dropout_rate", "attn_sched_dropout_p_layer0", "attn_sched_dropout_p_layer1"])
    rate, p0, p1 = (
        values["attn_sched_dropout_rate"],
        values["attn_sched_dropout_p_layer0"],
        values["attn_sched_dropout_p_layer1"],
    )
    for u in rate[0]:
        p = scheduled_p(u - 1)  # the update logged as num_updates u ran at update_num u - 1
        assert p0[0][u] == p1[0][u] == pytest.approx(p, abs=1e-4)
        # Thousands of real encoder-self units per update: the measured fraction is within a few points of p.
        assert rate[0][u] == pytest.approx(p, abs=0.03), (u, rate[0][u], p)
    for epoch in (1, 2):
        ps = [scheduled_p(u) for u in range((epoch - 1) * UPDATES_PER_EPOCH, epoch * UPDATES_PER_EPOCH)]
        assert p0[1][epoch] == pytest.approx(sum(ps) / len(ps), abs=1e-4)
        assert rate[1][epoch] == pytest.approx(sum(ps) / len(ps), abs=0.03)


def test_layerdrop_rate_counts_the_skipped_layer_calls(logged_runs):
    run = logged_runs("layerdrop")
    (rate, per_epoch) = logged(run, ["attn_layerdrop_rate"])["attn_layerdrop_rate"]
    calls = 6  # 2 layers x 3 attention kinds, each called once per training forward
    assert all(abs(r * calls - round(r * calls)) < 1e-3 for r in rate.values())  # k skipped of 6
    for epoch in (1, 2):  # every update has 6 calls: the epoch's rate is its updates' mean
        mean = sum(rate[u] for u in range((epoch - 1) * 12 + 1, epoch * 12 + 1)) / 12
        assert per_epoch[epoch] == pytest.approx(mean, abs=1e-3)
    overall = sum(rate.values()) / len(rate)  # 144 Bernoulli(p) draws: standard deviation 0.04
    assert overall == pytest.approx(LAYERDROP_P, abs=0.12)


def test_attendout_keys(logged_runs):
    run = logged_runs("attendout")
    keys = ["attendout_attacker_loss", "attendout_p_encoder-self.0", "attendout_p_encoder-self.1"]
    values = logged(run, keys)
    loss = {u: float(r["loss"]) for u, r in run["updates"].items()}
    attacker = values["attendout_attacker_loss"][0]
    assert all(abs(attacker[u] - loss[u]) < 0.5 for u in loss)  # the Attacker trains on the same batches
    for key in keys[1:]:  # the Generator's mean drop probability starts at --attendout-init-drop 0.2
        assert all(0.15 < v < 0.3 for v in values[key][0].values()), key


def test_hiddencut_keys(logged_runs):
    """HiddenCut's criterion-counted keys in the JSON log and in TensorBoard: the JS term in bits per
    target token, and the encoder positions cut of those seen (2 layers, default ratio 0.1, summed)."""
    run = logged_runs("hiddencut")
    values = logged(run, ["hiddencut_js", "hiddencut_cut", "hiddencut_tokens"])
    (js, _), (cut, cut_epoch), (tokens, tokens_epoch) = (
        values["hiddencut_js"],
        values["hiddencut_cut"],
        values["hiddencut_tokens"],
    )
    assert all(v > 0 for v in js.values())
    # A span of max(1, floor(0.1 n)) positions per sentence and layer: floor loses up to one per
    # sentence of these short ones (7.5% at the first update), the minimum of one adds to the shortest.
    assert all(0.03 < cut[u] / tokens[u] < 0.3 for u in cut), (cut, tokens)
    for epoch in (1, 2):  # sums: the epoch's value is its updates' total
        updates = range((epoch - 1) * UPDATES_PER_EPOCH + 1, epoch * UPDATES_PER_EPOCH + 1)
        assert cut_epoch[epoch] == sum(cut[u] for u in updates)
        assert tokens_epoch[epoch] == sum(tokens[u] for u in updates)
    assert "hiddencut_js" not in tensorboard_scalars(run["tb"]).get("valid", {})


def test_fairseq_train_starts_without_warnings(logged_runs):
    for name in ("plain", "ad_drop", "hiddencut"):
        warnings = re.findall(WARNING_LINE, logged_runs(name)["log"])
        assert warnings == [], warnings
    assert "Please install tensorboardX" not in logged_runs("plain")["log"]


def test_eval_bleu_is_0_when_every_hypothesis_is_empty(tiny_mt_data, tmp_path):
    """--best-checkpoint-metric bleu with no n-gram to count (max length 0: every hypothesis empty)
    logged no bleu in fairseq's translation task and stopped with KeyError: 'bleu'."""
    proc = fairseq_train(
        tiny_mt_data["bin"],
        [
            "--save-dir",
            tmp_path,
            *LOGGED_TRAIN["plain"],
            "--max-epoch",  # the last value counts
            "1",
            "--eval-bleu",
            "--eval-bleu-args",
            json.dumps({"max_len_a": 0, "max_len_b": 0, "min_len": 0}),
            "--eval-bleu-remove-bpe",
            "sentencepiece",
            "--best-checkpoint-metric",
            "bleu",
            "--maximize-best-checkpoint-metric",
        ],
    )
    valid = [json.loads(m) for m in re.findall(r"\| valid \| (\{.*\})", proc.stdout)]
    assert [v["valid_bleu"] for v in valid] == ["0"]
    assert (tmp_path / "checkpoint_best.pt").exists()


def test_eval_bleu_is_fairseqs_score_when_hypotheses_have_ngrams(tiny_mt_data):
    """The plugin's bleu (registered first whatever the batches hold) is sacrebleu's corpus score
    of all validation batches, also when a batch has only empty hypotheses (fairseq's own left
    that batch's references out of the brevity penalty: 45.05 here instead of 11.87)."""
    import sacrebleu
    from fairseq import metrics

    from helpers import fairseq_setup

    _, task, _, criterion = fairseq_setup(
        tiny_mt_data["bin"],
        ["--task", "attn_reg_translation", *TINY_TRANSFORMER, "--criterion", "label_smoothed_cross_entropy"]
        + ["--eval-bleu", "--optimizer", "adam"],
    )
    batches = [(["", ""], ["a b c d", "e f g h"]), (["a b c x", "e f"], ["a b c d", "e f g h"])]

    def log_of(hyps, refs):
        bleu = sacrebleu.corpus_bleu(hyps, [refs])
        log = {"loss": 1.0, "nll_loss": 1.0, "ntokens": 4, "nsentences": 2, "sample_size": 4}
        log.update(_bleu_sys_len=bleu.sys_len, _bleu_ref_len=bleu.ref_len)
        for i in range(4):
            log[f"_bleu_counts_{i}"], log[f"_bleu_totals_{i}"] = bleu.counts[i], bleu.totals[i]
        return log

    for batches_seen, expected in ((batches[:1], 0.0), (batches, None)):
        with metrics.aggregate(new_root=True) as agg:
            for hyps, refs in batches_seen:
                task.reduce_metrics([log_of(hyps, refs)], criterion)
            score = agg.get_smoothed_values()["bleu"]
        if expected is None:
            hyps = [h for hs, _ in batches for h in hs]
            refs = [r for _, rs in batches for r in rs]
            expected = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
            assert expected > 0
        assert score == expected


def test_tensorboard_serves_the_runs_scalars(logged_runs, tmp_path):
    """`tensorboard --logdir` (installed from the lock) starts on the run's folder and serves the
    regularizer's scalars over HTTP on the loopback address."""
    import shutil
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    tensorboard = shutil.which("tensorboard") or str(Path(sys.executable).parent / "tensorboard")
    log = tmp_path / "tensorboard.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [tensorboard, "--logdir", str(logged_runs("ad_drop")["tb"]), "--host", "127.0.0.1", "--port", "0"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = None
        for _ in range(600):  # the address it prints once it serves (at most 60 s)
            found = re.search(r"http://127\.0\.0\.1:\d+/", log.read_text())
            if found or server.poll() is not None:
                url = found and found.group(0)
                break
            time.sleep(0.1)
        assert url, log.read_text()[-2000:]
        tags = {}
        for _ in range(100):  # the first scan of the folder may still run
            with urllib.request.urlopen(url + "data/plugin/scalars/tags", timeout=10) as response:
                tags = json.loads(response.read())
            if "ad_drop_rate" in tags.get("train_inner", {}):
                break
            time.sleep(0.2)
        assert "ad_drop_rate" in tags.get("train_inner", {}), tags
    finally:
        server.terminate()
        server.wait(timeout=30)
