"""attn-reg-cls-compare (issue 71): the regularizers against plain on the user's own sentence classifier.

The Slurm case (a run requeued at its time limit) needs the one-node cluster of .ci/slurm-up.sh.

- end to end on the repository's movie reviews with a tiny random BERT (the MiniLM tokenizer): rows,
  scores recomputed from the runs, paired differences, learned-nothing flags in rows and verdicts;
- resume: finished runs are not run again, a stopped command keeps its finished runs, a run folder
  started with other arguments and a row renamed onto other options are refused;
- a run stopped mid-training (SIGTERM: saved at the end of its step; an error, as a kill leaves it: its
  last checkpoint) or at a job's time-limit signal (saved, then submitit's requeue) resumes from its
  checkpoint, and its scores and losses equal an uninterrupted run's;
- bad options and bad data are refused naming the option (or file and row) before anything trains;
- the statistics and the verdict on hand-made numbers.
"""

import json
import math
import os
import signal
import threading

import pytest

transformers = pytest.importorskip("transformers")

from attn_reg_plugin.classification import learned_nothing, paired_bootstrap_sd, scores  # noqa: E402
from attn_reg_plugin.sweep import cls_compare, cls_report, cls_runs  # noqa: E402
from attn_reg_plugin.sweep.options import SweepError  # noqa: E402
from attn_reg_plugin.sweep.processes import SweepStopped  # noqa: E402
from helpers import (  # noqa: E402
    REPO,
    failed_job_logs,
    job_when_ended,
    needs_slurm,
    release_requeues,
    tiny_classifier_folder,
)

REVIEWS = REPO / "data" / "movie_reviews"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random BERT classifier folder (MiniLM's tokenizer) and small slices of the movie reviews."""
    root = tmp_path_factory.mktemp("cls")
    tiny_classifier_folder(root / "model")
    rows = {s: (REVIEWS / f"{s}.jsonl").read_text(encoding="utf-8").splitlines() for s in cls_runs.SPLITS}
    for split, lines in rows.items():
        (root / f"{split}.jsonl").write_text("\n".join(lines[:32]) + "\n", encoding="utf-8")
    return root


def _argv(tiny, out, *extra):
    return [
        str(tiny / "model"), "--train", str(tiny / "train.jsonl"), "--dev", str(tiny / "dev.jsonl"),
        "--test", str(tiny / "test.jsonl"), "--out-dir", str(out), "--epochs", "1", "--max-length", "32",
        "--batch-size", "8", "--keep-going", *extra,
    ]  # fmt: skip


AD_DROP_EVERY_EPOCH = "ad-drop=--ad-drop-schedule always --ad-drop-attribution aa"


def test_end_to_end_rows_scores_differences_and_learned_nothing(tiny, tmp_path):
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", "plain,ad-drop", "--seeds", "1,2", "--method-args", AD_DROP_EVERY_EPOCH)
    assert cls_compare.main(argv, log=lambda line: None) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    rows = {m["name"]: m for m in results["methods"]}
    assert list(rows) == ["plain", "ad-drop_schedule=always_attribution=aa"]
    runs = {
        (name, seed): json.loads((out / "runs" / name / f"seed{seed}" / "result.json").read_text(encoding="utf-8"))
        for name in rows
        for seed in (1, 2)
    }
    for (name, seed), run in runs.items():
        assert run["dev"]["examples"] == run["test"]["examples"] == 32 and run["train_examples"] == 32
        assert run["learned_nothing"] == learned_nothing(run["dev"])  # the one definition, on the kept epoch
        assert rows[name]["metrics"]["test_mcc"]["per_seed"][str(seed)] == run["test"]["mcc"]
    ad_drop = rows["ad-drop_schedule=always_attribution=aa"]
    difference = ad_drop["differences"]["test_accuracy"]
    expected = [runs[(ad_drop["name"], s)]["test"]["accuracy"] - runs[("plain", s)]["test"]["accuracy"] for s in (1, 2)]
    assert [difference["per_seed"][str(s)] for s in (1, 2)] == pytest.approx(expected)
    seed_half = 12.706 * abs(expected[0] - expected[1]) / math.sqrt(2) / math.sqrt(2)  # t(0.975, 1) sd / sqrt(2)
    # The interval adds the test set's own noise: a paired bootstrap over the 32 test examples, read from
    # each run's predictions (recomputed here from the files), combined with the seeds' t-interval.
    predicted = {key: _predictions(out, *key) for key in runs}
    for key, rows_ in predicted.items():
        labels = sorted({r["gold"] for r in rows_} | {r["predicted"] for r in rows_})
        got = scores([labels.index(r["predicted"]) for r in rows_], [labels.index(r["gold"]) for r in rows_])
        assert [r["id"] for r in rows_] == list(range(32)) and got == runs[key]["test"]
    (method, gold), (plain, _) = (_as_classes(predicted, name) for name in (ad_drop["name"], "plain"))
    boot = paired_bootstrap_sd(method, plain, gold, "accuracy")
    assert difference["bootstrap_sd"] == pytest.approx(boot)
    half = math.hypot(seed_half, 1.96 * boot)
    if half:
        assert difference["ci"] == pytest.approx([sum(expected) / 2 - half, sum(expected) / 2 + half])
    else:  # identical predictions at every seed: an interval of zero width is no evidence, and is not shown as one
        assert difference["ci"] is None and difference["no_interval"].startswith("zero width")
    # A 16-wide random BERT after one epoch on 32 reviews does no better than the majority class: said in
    # the rows and in the verdict, which does not compare it.
    assert all(run["learned_nothing"] for run in runs.values())
    md = (out / "results.md").read_text(encoding="utf-8")
    flat = " ".join(md.split())  # results.md's prose is wrapped at 100 columns
    for name in rows:
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} | 1,2 | "))  # the first table's
        assert row.endswith("| 0 of 2 |")  # how many of its runs learned anything
        for seed in (1, 2):
            assert f"- {name} seed {seed}: {runs[(name, seed)]['learned_nothing']}" in flat
    (verdict,) = results["verdicts"]
    assert verdict.startswith(f"{ad_drop['name']}: not compared: learned nothing at every seed (1, 2)")
    assert "plain learned nothing at every seed" in verdict
    ad_drop_epoch = runs[(ad_drop["name"], 1)]["epochs"][0]
    assert ad_drop_epoch["ad_drop_on"] == 1 and ad_drop_epoch["ad_drop_rate"] > 0  # AD-DROP ran


def _predictions(out, name, seed):
    path = out / "runs" / name / f"seed{seed}" / "predictions.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _as_classes(predicted, name):
    """``({seed: classes}, gold)`` of one row's predictions files, labels as their sorted names' places."""
    first = next(rows for (n, _), rows in predicted.items() if n == name)
    labels = sorted(
        {r["gold"] for rows in predicted.values() for r in rows}
        | {r["predicted"] for rows in predicted.values() for r in rows}
    )
    by_seed = {seed: [labels.index(r["predicted"]) for r in rows] for (n, seed), rows in predicted.items() if n == name}
    return by_seed, [labels.index(r["gold"]) for r in first]


def test_resume_skips_finished_runs_and_a_stop_keeps_them(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", "plain,r-drop", "--seeds", "1")
    trained = []
    real = cls_runs.run_classifier

    def stopped_at_r_drop(cell, seed, *args, **kwargs):
        trained.append((cell["name"], seed))
        if cell["name"] == "r-drop":
            raise SweepStopped(signal.SIGTERM)  # as the signal handler raises it mid-training
        return real(cell, seed, *args, **kwargs)

    monkeypatch.setattr(cls_runs, "run_classifier", stopped_at_r_drop)
    assert cls_compare.main(argv, log=lambda line: None) == 128 + signal.SIGTERM
    assert (out / "runs" / "plain" / "seed1" / "result.json").exists()
    assert not (out / "runs" / "r-drop" / "seed1" / "result.json").exists()
    assert not (out / "sweep.lock").exists()  # the lock is released

    trained.clear()
    monkeypatch.setattr(
        cls_runs,
        "run_classifier",
        lambda cell, seed, *a, **k: trained.append(cell["name"]) or real(cell, seed, *a, **k),
    )
    lines = []
    assert cls_compare.main(argv, log=lines.append) == 0
    assert trained == ["r-drop"]  # plain's finished run was kept
    assert any("plain seed 1: kept from" in line for line in lines)

    trained.clear()
    assert cls_compare.main([*argv[:-1], "1,2"], log=lines.append) == 0  # a seed more: only its runs
    assert trained == ["plain", "r-drop"]
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert [m["seeds"] for m in results["methods"]] == [[1, 2], [1, 2]]


def test_a_run_started_with_other_arguments_is_refused(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", "plain,r-drop", "--seeds", "1", "--method-args", "r-drop:mine=--rdrop-alpha 2")
    assert cls_compare.main(argv, log=lambda line: None) == 0
    # The same row name with other options: refused before anything runs.
    other = [a if a != "r-drop:mine=--rdrop-alpha 2" else "r-drop:mine=--rdrop-alpha 3" for a in argv]
    with pytest.raises(SystemExit):
        cls_compare.main(other, log=lambda line: None)
    assert "ran mine with ['--rdrop-alpha', '2'], now ['--rdrop-alpha', '3']" in capsys.readouterr().err
    # A run folder whose command.json records another command line (a plugin whose defaults changed).
    seed_dir = out / "runs" / "plain" / "seed2"
    seed_dir.mkdir(parents=True)
    (seed_dir / "command.json").write_text(json.dumps({"command": ["attn-reg-cls-compare", "--lr", "1"]}))
    with pytest.raises(SystemExit):
        cls_compare.main([*argv[:-3], "1,2", *argv[-2:]], log=lambda line: None)
    assert f"{seed_dir} was started with other attn-reg-cls-compare arguments" in capsys.readouterr().err


# -- a run stopped mid-training resumes from its checkpoint ------------------------------------------
RESUMED_METHODS = "plain,ad-drop,attendout"  # AD-DROP cross-tuning: plain in epoch 1, AD-DROP in epoch 2
ATTENDOUT_EVERY_2 = "attendout:game=--attendout-dropout-step 2"  # its game has state at every checkpoint
RESUMED_ROWS = ["plain", "ad-drop", "game"]
RESUMED_TRAINING = ["--epochs", "2", "--lr", "1e-3", "--method-args", ATTENDOUT_EVERY_2]  # 4 steps an epoch


def _interrupt(monkeypatch, row, step, how):
    """Row ``row``'s training is interrupted at the end of optimizer step ``step``: a signal's name, that
    signal to this process; ``crash``, an error there (nothing more saved, as a kill leaves it)."""
    real = cls_runs.build_trainer

    class Interrupt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step and how != "crash":
                os.kill(os.getpid(), getattr(signal, how))
            elif state.global_step == step:
                raise RuntimeError(f"killed at step {step}")

    def build(cell, *args, **kwargs):
        trainer = real(cell, *args, **kwargs)
        if cell["name"] == row:
            trainer.add_callback(Interrupt())
        return trainer

    monkeypatch.setattr(cls_runs, "build_trainer", build)


def _results(out, rows):
    return {row: json.loads((out / "runs" / row / "seed1" / "result.json").read_text(encoding="utf-8")) for row in rows}


_REFERENCE = {}


def _uninterrupted(tiny, tmp_path_factory):
    """The rows' runs uninterrupted (once per session: every case compares with them)."""
    if not _REFERENCE:
        out = tmp_path_factory.mktemp("uninterrupted")
        argv = _argv(tiny, out, "--methods", RESUMED_METHODS, *RESUMED_TRAINING)
        assert cls_compare.main(argv, log=lambda line: None) == 0
        _REFERENCE.update(_results(out, RESUMED_ROWS))
    return _REFERENCE


@pytest.mark.parametrize(
    "row, step, how, save_steps, saved",
    [
        ("ad-drop", 5, "SIGTERM", "0", 6),  # SIGTERM in step 5: saved at the end of step 6, mid epoch 2
        ("game", 7, "crash", "3", 6),  # killed at step 7: its last checkpoint, step 6 (every 3 steps)
    ],
)
def test_a_run_stopped_mid_training_resumes_from_its_checkpoint_with_the_uninterrupted_result(
    tiny, tmp_path, tmp_path_factory, monkeypatch, row, step, how, save_steps, saved
):
    reference = _uninterrupted(tiny, tmp_path_factory)
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", RESUMED_METHODS, *RESUMED_TRAINING)
    argv += ["--save-steps", save_steps]
    _interrupt(monkeypatch, row, step, how)
    lines = []
    if how == "SIGTERM":
        assert cls_compare.main(argv, log=lines.append) == 128 + signal.SIGTERM
        assert (
            f"    {row} seed 1: SIGTERM during training: saved checkpoint-{saved} (step {saved} of 8, epoch 1.50); "
            "the run resumes there" in lines[-1]
        )
    else:
        with pytest.raises(RuntimeError, match=f"killed at step {step}"):
            cls_compare.main(argv, log=lines.append)
    trainer_dir = out / "runs" / row / "seed1" / "trainer"
    assert not (trainer_dir.parent / "result.json").exists()
    assert sorted(p.name for p in trainer_dir.iterdir()) == ["best-epoch1.pt", f"checkpoint-{saved}"]  # the last only
    (trainer_dir / "checkpoint-9").mkdir()  # a save cut off by a kill: no checkpoint, removed

    monkeypatch.undo()
    lines.clear()
    assert cls_compare.main(argv, log=lines.append) == 0
    assert (
        f"    {row} seed 1: resuming from checkpoint-{saved}, saved by an earlier attempt (step {saved} of 8; 1 epoch(s) scored on dev)"
        in lines
    )
    assert not trainer_dir.exists()  # the finished run's checkpoint is removed
    resumed = _results(out, RESUMED_ROWS)
    for name, run in resumed.items():
        expected = reference[name]
        assert (run["dev"], run["test"], run["best_epoch"]) == (
            expected["dev"],
            expected["test"],
            expected["best_epoch"],
        )
        assert [e["train_loss"] for e in run["epochs"]] == [e["train_loss"] for e in expected["epochs"]]
        assert [e["dev"] for e in run["epochs"]] == [e["dev"] for e in expected["epochs"]]
        assert run["resumed_at_steps"] == ([saved] if name == row else [])
    first, second = resumed[row]["epochs"]
    assert first == reference[row]["epochs"][0] and second["resumed_at_step"] == saved  # its own logs: since then
    assert resumed[row]["resumed_at_epochs"] == [2]
    if row == "ad-drop":  # cross-tuning's epoch 2 ran AD-DROP after the resume too
        assert [e["ad_drop_on"] for e in resumed[row]["epochs"]] == [0, 1]
    results = (out / "results.md").read_text(encoding="utf-8")
    assert f"- {row} seed 1: resumed at epoch 2 (step {saved})\n" in results


@pytest.mark.slow  # a submitit process per run, each importing transformers: about 40 s on 2 cores
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--jobs 2 needs 2 cores")
def test_two_local_jobs_at_once_resume_a_stopped_run_and_equal_the_runs_one_at_a_time(
    tiny, tmp_path, tmp_path_factory, monkeypatch
):
    """A command stopped in its second row's run; the same command with --launcher local --jobs 2
    then resumes that run in one job while the third row's run trains in another; the results are --jobs 1's."""
    pytest.importorskip("submitit")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the jobs' threads: CPU training the same in every process
    reference = _uninterrupted(tiny, tmp_path_factory)
    out = tmp_path / "out"
    argv = _argv(tiny, out, "--methods", RESUMED_METHODS, *RESUMED_TRAINING)
    with monkeypatch.context() as stopped:
        _interrupt(stopped, "ad-drop", 5, "SIGTERM")
        assert cls_compare.main(argv, log=lambda line: None) == 128 + signal.SIGTERM
    lines = []
    assert cls_compare.main([*argv, "--jobs", "2"], log=lines.append) == 0
    (finished,) = [line for line in lines if "] ad-drop/seed1: finished (job " in line]
    assert finished.endswith("; resumed at epoch 2 (step 6)")  # the launcher's line, from the job's result.json
    assert len(list((out / "jobs").glob("*_0_log.out"))) == 2  # two submitit jobs ran them
    logs = [p.read_text(encoding="utf-8") for p in (out / "jobs").glob("*_0_log.out")]
    assert all("seed 1: step 8/8 (epoch 2.00 of 2), loss " in log for log in logs)  # each run's progress, in its log
    for name, run in _results(out, RESUMED_ROWS).items():
        expected = reference[name]
        assert (run["dev"], run["test"], run["epochs"][0]) == (expected["dev"], expected["test"], expected["epochs"][0])
        assert run["epochs"][1]["train_loss"] == expected["epochs"][1]["train_loss"]
        assert run["resumed_at_steps"] == ([6] if name == "ad-drop" else [])


def test_a_jobs_time_limit_signal_saves_the_run_before_submitit_requeues_it(tiny, tmp_path, monkeypatch):
    """In a submitit job SIGUSR2 is submitit's: checkpoint the job (``RunJob.checkpoint``: no child to
    wait for), requeue it and exit. Training defers it to the end of its step, saves, then calls it;
    the requeued job resumes the run."""
    from attn_reg_plugin.sweep.launcher import RunJob

    out = tmp_path / "out"
    _, opts = cls_compare.parse_cls_compare_args(
        _argv(tiny, out, "--methods", "plain,r-drop", "--epochs", "2", "--launcher", "local", "--jobs", "2")
    )
    opts.settings = settings = cls_compare.settings_of(opts)
    cell = opts.cells[1]
    trainer_dir = out / "runs" / "r-drop" / "seed1" / "trainer"
    requeued = []

    def submitit_handler(signum, frame):
        requeued.append(sorted(p.name for p in trainer_dir.glob("checkpoint-*")))
        delayed = RunJob(cls_runs.run_cls_job).checkpoint(cell, 1, opts, settings)
        assert delayed.args == (cell, 1, opts, settings)
        raise SystemExit(-1)  # submitit's exit after `scontrol requeue`

    kept = signal.signal(signal.SIGUSR2, submitit_handler)
    try:
        _interrupt(monkeypatch, "r-drop", 2, "SIGUSR2")
        with pytest.raises(SystemExit):
            cls_runs.run_cls_job(cell, 1, opts, settings)
        assert requeued == [["checkpoint-3"]]  # saved at the end of step 3, then requeued
        monkeypatch.undo()
        result = cls_runs.run_cls_job(cell, 1, opts, settings)  # the requeued job
        assert result["resumed_at_steps"] == [3] and result["resumed_at_epochs"] == [1]
    finally:
        signal.signal(signal.SIGUSR2, kept)


def test_a_deferred_signal_waits_for_act_and_a_second_one_acts_at_once():
    """processes.DeferredStop: what training does with a stop signal until its step's checkpoint is saved."""
    import threading

    from attn_reg_plugin.sweep.processes import DeferredStop

    calls = []
    handler = lambda signum, frame: calls.append(signum)  # noqa: E731
    kept = signal.signal(signal.SIGUSR2, handler)
    try:
        with DeferredStop() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert (calls, stop.name) == ([], "SIGUSR2")  # recorded only
            stop.act()
            assert (calls, stop.requested) == ([signal.SIGUSR2], None)  # its own handler, which returned: armed again
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert calls == [signal.SIGUSR2] * 2  # the second at once
        assert calls == [signal.SIGUSR2] * 3  # the one still unanswered, when training ended
        assert signal.getsignal(signal.SIGUSR2) is handler
        seen = []

        def off_the_main_thread():
            try:
                with DeferredStop() as stop:
                    seen.append(stop.kept)
            except BaseException as e:
                seen.append(e)

        outside = threading.Thread(target=off_the_main_thread)
        outside.start()
        outside.join()
        assert seen == [{}] and signal.getsignal(signal.SIGUSR2) is handler  # nothing deferred, nothing raised
    finally:
        signal.signal(signal.SIGUSR2, kept)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "plain,ad-drop", "--epochs", "0"], "--epochs must be an integer >= 1, got 0"),
        (["--methods", "plain,r-drop", "--lr", "-1"], "--lr must be a positive number, got -1.0"),
        (["--methods", "plain,r-drop", "--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1), got 1.0"),
        (["--methods", "plain,r-drop", "--train-size", "1"], "--train-size must be an integer >= 2, got 1"),
        (["--methods", "plain,r-drop", "--seeds", "1,1"], "--seeds must be a comma list of distinct integers"),
        (["--methods", "r-drop"], "give plain and at least one method to compare with it"),
        (["--methods", "plain,dropout"], "'dropout' is not a method; accepted here: plain, ad-drop, attendout"),
        (["--methods", "plain,ad-drop", "--method-args", "ad-drop=--ad-drop-p 1.5 --ad-drop-schedule always"],
         "--method-args ad-drop: --ad-drop-p must be in the open interval (0, 1), got 1.5"),
        (["--methods", "plain,r-drop", "--method-args", "r-drop=--ad-drop-p 0.2"],
         "r-drop's options are --rdrop-*; got --ad-drop-p"),
        (["--methods", "plain,ad-drop"], "--epochs 1 with ad-drop's --ad-drop-schedule cross-tuning never runs AD-DROP"),
        (["--methods", "plain,r-drop", "--jobs", "999"], "--jobs must be an integer from 1 to this machine's"),
        (["--methods", "plain,r-drop", "--dataset", "glue"], "give files or a dataset, not both"),
        (["--methods", "plain,r-drop", "--save-steps", "-1"],
         "--save-steps must be an integer >= 0 (0: at epoch ends only), got -1"),
        (["--methods", "plain,r-drop", "--log-steps", "-1"],
         "--log-steps must be an integer >= 0 (0: about five lines an epoch), got -1"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_the_option(tiny, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        cls_compare.main(_argv(tiny, tmp_path / "out", *extra))
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # before anything is written


def test_bad_data_is_refused_naming_file_and_row(tiny, tmp_path, capsys):
    dev = tmp_path / "dev.jsonl"
    dev.write_text('{"sentence": "fine", "label": 1}\n{"sentence": "odd", "label": 7}\n', encoding="utf-8")
    argv = _argv(tiny, tmp_path / "out", "--methods", "plain,r-drop")
    argv[argv.index("--dev") + 1] = str(dev)
    with pytest.raises(SystemExit):
        cls_compare.main(argv)
    assert f"--dev {dev}: labels ['7'] never occur in --train's ['0', '1']" in capsys.readouterr().err
    dev.write_text('{"sentence": "", "label": 1}\n', encoding="utf-8")
    with pytest.raises(SystemExit):
        cls_compare.main(argv)
    assert f"{dev}:1: field 'sentence' must be a non-empty string" in capsys.readouterr().err


def test_a_datasets_folder_is_read_as_the_files_are(tiny, tmp_path):
    """--dataset goes through datasets.load_dataset (offline here: a local folder of JSON-lines splits)."""
    pytest.importorskip("datasets")
    import argparse

    folder = tmp_path / "reviews"
    folder.mkdir()
    for split, name in zip(cls_runs.SPLITS, ("train", "validation", "test")):
        (folder / f"{name}.jsonl").write_text((tiny / f"{split}.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    opts = argparse.Namespace(
        dataset=str(folder), dataset_config=None, train_split="train", dev_split="validation", test_split="test",
        text_field="sentence", pair_field=None, label_field="label",
    )  # fmt: skip
    data = cls_runs.read_data(opts)
    files = cls_runs.read_data(
        argparse.Namespace(**{**vars(opts), "dataset": None, **{s: tiny / f"{s}.jsonl" for s in cls_runs.SPLITS}})
    )
    assert data == files and data.labels == ["0", "1"]
    opts.dev_split = "dev"
    with pytest.raises(SweepError, match=f"--dataset {folder} --dev-split dev: Unknown split"):
        cls_runs.read_data(opts)


# -- the statistics and the verdict on hand-made numbers --------------------------------------------
def _record(name, accuracies, dev_accuracies, nothing=()):
    runs = []
    for seed, (test, dev) in enumerate(zip(accuracies, dev_accuracies), 1):
        scores = lambda a: {"accuracy": a, "macro_f1": a - 0.1, "mcc": 2 * a - 1}
        why = "predicts one class for all 100 examples" if seed in nothing else None
        runs.append({"seed": seed, "dev": scores(dev), "test": scores(test), "best_epoch": 1, "learned_nothing": why})
    method = name.split("_")[0]
    return {"name": name, "cell": {"method": method, "name": name, "args": []}, "seeds": [1, 2, 3], "runs": runs}


def test_paired_differences_intervals_and_verdicts_on_hand_made_numbers():
    plain = _record("plain", [0.80, 0.82, 0.81], [0.79, 0.80, 0.81])
    better = _record("r-drop", [0.83, 0.84, 0.85], [0.80, 0.80, 0.80])
    summary = cls_report.cls_row_summary(better, plain, "accuracy", [])
    d = summary["differences"]["test_accuracy"]
    assert d["per_seed"] == pytest.approx({1: 0.03, 2: 0.02, 3: 0.04})
    half = 4.303 * 0.01 / math.sqrt(3)  # t(0.975, 2) x sd / sqrt(3)
    assert d["mean"] == pytest.approx(0.03) and d["sd"] == pytest.approx(0.01)
    assert d["ci"] == pytest.approx([0.03 - half, 0.03 + half])
    assert summary["differences"]["test_mcc"]["mean"] == pytest.approx(0.06)
    assert summary["verdict"] == "r-drop: better: test accuracy +0.0300 [+0.0052, +0.0548] at 3 seeds"

    noise = _record("dropkey", [0.79, 0.84, 0.82], [0.80, 0.80, 0.81])
    text = cls_report.cls_row_summary(noise, plain, "accuracy", [])["verdict"]
    assert text.startswith("dropkey: not distinguishable from plain at 3 seeds (test accuracy +0.0067 [")

    dev_only = _record("ad-drop", [0.79, 0.84, 0.82], [0.82, 0.84, 0.83])
    text = cls_report.cls_row_summary(dev_only, plain, "accuracy", [])["verdict"]
    assert text.startswith("ad-drop: better on dev accuracy at every seed (dev accuracy +0.0300 [")
    # The same +0.03 at every seed, with no predictions to bootstrap the test set: an interval of zero
    # width, which is no evidence (it read "better: +0.0300 [+0.0300, +0.0300]").
    same = _record("ad-drop", [0.83, 0.85, 0.84], [0.80, 0.80, 0.80])
    d = cls_report.cls_row_summary(same, plain, "accuracy", [])
    assert d["differences"]["test_accuracy"]["ci"] is None
    assert d["verdict"].startswith(
        "ad-drop: not distinguishable from plain at 3 seeds (test accuracy +0.0300 (zero width: no spread"
    )

    partly = _record("hiddencut", [0.83, 0.84, 0.85], [0.80, 0.80, 0.80], nothing={2})
    summary = cls_report.cls_row_summary(partly, plain, "accuracy", [])
    assert summary["flags"] == [] and summary["learned_nothing"] == {2: "predicts one class for all 100 examples"}
    assert summary["verdict"].endswith(
        "; hiddencut learned nothing at seed 2 (on dev: predicts one class for all 100 examples)"
    )
    empty_plain = _record("plain", [0.5, 0.5, 0.5], [0.5, 0.5, 0.5], nothing={1, 2, 3})
    text = cls_report.cls_row_summary(better, empty_plain, "accuracy", [])["verdict"]
    assert text.startswith("r-drop: not compared: plain learned nothing at every seed (1, 2, 3)")


# -- round six: the model's identity, the data's forms, fast refusals ----------------------------------
def test_a_model_whose_weights_changed_at_the_same_path_is_refused(tiny, tmp_path):
    """The model folder is identified by the sha256 of its files, as the data files are: new weights at
    the same path made a rerun print "seed 1: kept" and pair old-weight seed 1 with new-weight seed 2."""
    import shutil

    import torch

    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    out = tmp_path / "out"
    argv = [str(model), *_argv(tiny, out, "--methods", "plain,dropkey", "--seeds", "1")[1:]]
    assert cls_compare.main(argv, log=lambda line: None) == 0
    saved = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    assert saved["model_sha256"] == cls_compare.model_digest(model)
    torch.manual_seed(1)
    config = transformers.AutoConfig.from_pretrained(model)
    transformers.BertForSequenceClassification(config).save_pretrained(model)  # other weights, same path
    with pytest.raises(SystemExit):
        cls_compare.main([*argv[:-1], "1,2"], log=lambda line: None)
    assert not (out / "runs" / "plain" / "seed2").exists() and not (out / "runs" / "dropkey" / "seed2").exists()


def test_help_and_a_wrong_field_come_before_transformers_is_imported():
    """--help and the data's checks need neither transformers nor peft (about 3 s of imports here): a
    wrong --text-field is refused before them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from attn_reg_plugin.sweep import cls_compare\n"
        "try:\n"
        "    cls_compare.main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('HEAVY', sorted(m for m in ('transformers', 'peft') if m in sys.modules))\n"
    )
    files = [w for s in cls_runs.SPLITS for w in (f"--{s}", str(REVIEWS / f"{s}.jsonl"))]
    for argv in (["--help"], ["no-such-model", *files, "--out-dir", "/nonexistent/out", "--methods", "plain,ad-drop", "--text-field", "text"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip().splitlines()[-1] == "HEAVY []", done.stdout + done.stderr
    assert "no field 'text'; the row's fields are 'sentence', 'label' (name the right one with --text-field)" in (
        done.stderr
    )


def test_the_help_says_what_slurm_tasks_per_node_sets_here(capsys):
    with pytest.raises(SystemExit):
        cls_compare.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--slurm-tasks-per-node N tasks per job: 1 only (default 1), each run one Trainer process" in text
    assert "fairseq-train" not in text


def _write_split(path, rows, label_field="label"):
    """``rows`` of (text, label) in the file's format, by its suffix."""
    records = [{"sentence": text, label_field: label} for text, label in rows]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    else:
        sep = "\t" if path.suffix == ".tsv" else ","
        path.write_text(f"sentence{sep}{label_field}\n" + "".join(f"{t}{sep}{y}\n" for t, y in rows), encoding="utf-8")


def _reviews(n, labels):
    texts = [json.loads(line)["sentence"] for line in (REVIEWS / "train.jsonl").read_text().splitlines()[:n]]
    return [(text.replace(",", " ").replace("\t", " ").replace('"', "'"), labels[i % len(labels)]) for i, text in enumerate(texts)]  # fmt: skip


@pytest.mark.parametrize(
    "suffix, labels",
    [
        (".jsonl", [0, 1, 2]),  # three classes
        (".csv", [1, 2]),  # labels 1/2, not 0/1
        (".tsv", ["neg", "pos"]),  # string labels, GLUE's TSV
        (".json", ["pos", "neg", "neutral"]),  # a JSON array
    ],
    ids=["three-classes", "labels-1-2", "string-labels-tsv", "json-array"],
)
def test_end_to_end_on_each_form_of_labels_and_file(tiny, tmp_path, suffix, labels):
    """The whole command on each: the labels in numeric (else text) order are the model's classes, every
    run's predictions name them per test example, and the scores are those predictions'."""
    rows = _reviews(24, labels)
    if suffix == ".tsv":
        rows[3] = ('"A classic" it is not', rows[3][1])  # a text opening with a quote: still one row
    files = {split: tmp_path / f"{split}{suffix}" for split in cls_runs.SPLITS}
    for path in files.values():
        _write_split(path, rows)
    out = tmp_path / "out"
    argv = [str(tiny / "model"), *[w for s, p in files.items() for w in (f"--{s}", str(p))], "--out-dir", str(out)]
    argv += ["--methods", "plain,dropkey", "--epochs", "1", "--max-length", "32", "--batch-size", "8", "--keep-going"]
    assert cls_compare.main(argv, log=lambda line: None) == 0
    names = [str(y) for y in labels]
    expected_order = sorted(set(names), key=float) if suffix in (".jsonl", ".csv") else sorted(set(names))
    for row in ("plain", "dropkey"):
        run = json.loads((out / "runs" / row / "seed1" / "result.json").read_text(encoding="utf-8"))
        assert list(run["train_labels"]) == expected_order
        assert run["train_labels"] == {name: sum(str(y) == name for _, y in rows) for name in expected_order}
        predicted = _predictions(out, row, 1)
        assert [p["gold"] for p in predicted] == [str(y) for _, y in rows]
        assert {p["predicted"] for p in predicted} <= set(names)
        got = scores([names.index(p["predicted"]) for p in predicted], [names.index(p["gold"]) for p in predicted])
        assert got == run["test"]
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert [m["name"] for m in results["methods"]] == ["plain", "dropkey"] and len(results["verdicts"]) == 1


def test_end_to_end_with_a_datasets_name(tiny, tmp_path):
    """--dataset through the whole command (offline: ``datasets.load_dataset`` of a local folder, the name
    a user passes for their own data; a hub name goes the same way)."""
    pytest.importorskip("datasets")
    folder = tmp_path / "my_reviews"
    folder.mkdir()
    for split, name in zip(cls_runs.SPLITS, ("train", "validation", "test")):
        (folder / f"{name}.jsonl").write_text((tiny / f"{split}.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "out"
    argv = [str(tiny / "model"), "--dataset", str(folder), "--test-split", "test", "--out-dir", str(out)]
    argv += ["--methods", "plain,dropkey", "--epochs", "1", "--max-length", "32", "--batch-size", "8", "--keep-going"]
    assert cls_compare.main(argv, log=lambda line: None) == 0
    settings = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    assert settings["data"] == {
        "dataset": str(folder),
        "config": None,
        "train": "train",
        "dev": "validation",
        "test": "test",
    }
    run = json.loads((out / "runs" / "plain" / "seed1" / "result.json").read_text(encoding="utf-8"))
    gold = [str(json.loads(line)["label"]) for line in (tiny / "test.jsonl").read_text().splitlines()]
    assert [p["gold"] for p in _predictions(out, "plain", 1)] == gold and run["test"]["examples"] == len(gold)


def test_a_comparison_whose_runs_all_failed_writes_results_naming_them(tiny, tmp_path):
    """As attn-reg-mt-compare does: results.md and results.json with failed_runs, nothing compared."""
    import argparse

    out = tmp_path / "out"
    out.mkdir()
    failed = [
        {"name": name, "seed": 1, "job": f"7_{i}", "state": "TIMEOUT", "error": "time limit", "log": "jobs/x.out"}
        for i, name in enumerate(("plain", "r-drop"))
    ]
    opts = argparse.Namespace(
        out_dir=out, model="m", epochs=1, metric="accuracy", failed_runs=failed, settings={"command": "x"}
    )
    summary = cls_report.write_cls_comparison([], opts, "data", 0.0, lambda line: None)
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert saved["failed_runs"] == failed and saved["methods"] == [] and summary["failed_runs"] == failed
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "No run finished: all 2 run(s) of this command failed, so nothing is compared." in md
    assert "- r-drop seed 1: job 7_1 TIMEOUT: time limit; log jobs/x.out" in md


@needs_slurm
@pytest.mark.xdist_group("slurm")  # one worker runs every Slurm test: the one-node cluster has 2 CPUs
def test_a_classifier_run_longer_than_the_time_limit_is_requeued_and_completes(tiny, tmp_path, monkeypatch):
    """--slurm-time 1 (Slurm's least; it signals the job 15 s before, up to a minute early, its
    resolution) for a run of about a minute of training: the Trainer saves at the end of the step the
    signal came in, submitit requeues the job (the same job id), and the requeued job resumes from
    that checkpoint to the end. Each attempt here was signalled 19-28 s after it started and trained
    700-1,000 steps of the 3,600 (4 requeues, two quiet cores or a busy one); a loaded machine spends
    more of each attempt starting, so the requeues allowed are many."""
    pytest.importorskip("submitit")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    argv = [
        str(tiny / "model"), "--train", str(tiny / "train.jsonl"), "--dev", str(tiny / "dev.jsonl"),
        "--test", str(tiny / "test.jsonl"), "--out-dir", str(out), "--methods", "plain,dropkey",
        "--epochs", "900", "--max-length", "32", "--batch-size", "8", "--save-steps", "0",
        "--launcher", "slurm", "--slurm-time", "1", "--slurm-max-requeues", "30", "--keep-going",
    ]  # fmt: skip
    keys = ("plain/seed1", "dropkey/seed1")
    done = threading.Event()
    helpers = [threading.Thread(target=release_requeues, args=(out, key, done), daemon=True) for key in keys]
    for helper in helpers:
        helper.start()
    lines = []
    try:
        status = cls_compare.main(argv, log=lines.append)
    finally:
        done.set()
    assert status == 0, "\n".join(lines + failed_job_logs(out))
    jobs = json.loads((out / "jobs.json").read_text(encoding="utf-8"))
    for key in keys:
        run = json.loads((out / "runs" / key / "result.json").read_text(encoding="utf-8"))
        assert run["resumed_at_steps"] and run["epochs"][-1]["epoch"] == 900, run["resumed_at_steps"]
        shown = job_when_ended(jobs[key])
        restarts = int(shown.split("Restarts=", 1)[1].split()[0])
        assert "JobState=COMPLETED" in shown and restarts >= len(run["resumed_at_steps"]), shown
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "- plain seed 1: resumed at epoch " in md and "- dropkey seed 1: resumed at epoch " in md
