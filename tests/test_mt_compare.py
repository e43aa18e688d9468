"""attn-reg-mt-compare (issue 42, part 2): the methods against plain on the user's run, on stand-in
fairseq children (tests/fake_fairseq.py), and its statistics on hand-made records.

- methods are parsed and refused before any run (unknown, unavailable, misplaced options);
- each method's fairseq-train arguments reach its runs;
- means, sample sds ("n/a" for one seed), paired differences and their 95% t-intervals, checked by hand;
- sacrebleu's own paired bootstrap test is called on the runs' test hypotheses and references, and its
  p-value is what the table shows;
- the verdict in words for constructed cases; results accumulate over commands.
"""

import json
import math
import os
import re
import sys
from pathlib import Path

import fake_fairseq
import pytest

from attn_reg_plugin.sweep import compare, compare_report, methods, paired
from attn_reg_plugin.sweep import runs as sweep_runs
from attn_reg_plugin.sweep.verdict import summarize
from helpers import TINY_MT_TRAIN

REFS = [f"the {a} cat sees the {b} dog again today." for a in ("big", "small", "old", "new") for b in ("red", "white")]
ALL = "plain,ad-drop,r-drop,dropkey,attendout"
# What plugin_provides says of a plugin without HiddenCut and DropHead: criteria, task options.
PROVIDED = {
    "label_smoothed_cross_entropy",
    "ad_drop_label_smoothed_cross_entropy",
    "rdrop_label_smoothed_cross_entropy",
    "--attn-sched-dropout-schedule",
    "--attendout",
}


def _data_bin(root: Path) -> Path:
    """Just the files the command checks: dictionaries of 10 types, empty train/valid/test binaries."""
    data_bin = root / "data-bin"
    data_bin.mkdir()
    for lang in ("tr", "en"):
        (data_bin / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(10)))
        for split in ("train", "valid", "test"):
            for ext in ("bin", "idx"):
                (data_bin / f"{split}.tr-en.{lang}.{ext}").write_bytes(b"")
    return data_bin


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """``fake["plan"](**plan)`` sets the children's plan, ``fake["argv"](out, ...)`` a command line,
    ``fake["calls"]`` counts the children started."""
    data_bin = _data_bin(tmp_path)
    plan_path = tmp_path / "plan.json"
    exes = fake_fairseq.install(tmp_path / "bin", plan_path)
    calls = {"fairseq-train": 0, "fairseq-generate": 0}
    real = sweep_runs.run_appended

    def run(cmd, *args, **kwargs):
        calls[cmd[0].rsplit("/", 1)[-1]] += 1
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(sweep_runs, "fairseq_command", lambda name: exes[name])
    monkeypatch.setattr(sweep_runs, "run_appended", run)
    monkeypatch.setattr(compare, "check_fairseq_args", lambda *a: None)
    monkeypatch.setattr(compare, "plugin_provides", lambda: set(PROVIDED))

    def plan(**kwargs):
        fake_fairseq.write_plan(plan_path, refs=REFS, **kwargs)

    def argv(out, *extra, methods=ALL, seeds="1,2", epochs="3", train=("--arch", "transformer", "--cpu")):
        return [
            str(data_bin), "--out-dir", str(out), "--methods", methods, "--epochs", epochs, "--seeds", seeds,
            *extra, "--", *train,
        ]  # fmt: skip

    plan()
    return {"plan": plan, "argv": argv, "calls": calls}


# -- methods and refusals -------------------------------------------------------------------------
def test_methods_are_parsed_in_order_plain_first_and_refused_when_unavailable():
    assert methods.parse_methods("r-drop, plain,dropkey", PROVIDED) == ["plain", "r-drop", "dropkey"]
    with pytest.raises(
        methods.SweepError,
        match=r"'dropout' is not a method; accepted here: plain, ad-drop, attendout, r-drop, dropkey$",
    ):
        methods.parse_methods("plain,dropout", PROVIDED)
    with pytest.raises(
        methods.SweepError, match="hiddencut: the installed plugin has no fairseq criterion hiddencut_label_smoothed"
    ):
        methods.parse_methods("plain,hiddencut", PROVIDED)
    with pytest.raises(
        methods.SweepError,
        match="drophead: the installed plugin has no task option --attn-drophead-schedule; accepted here: plain, ",
    ):
        methods.parse_methods("plain,drophead", PROVIDED)
    # Each is accepted once the plugin provides its criterion or task option.
    more = PROVIDED | {"hiddencut_label_smoothed_cross_entropy", "--attn-drophead-schedule"}
    assert methods.parse_methods("plain,hiddencut,drophead", more) == ["plain", "hiddencut", "drophead"]
    for text, message in (
        ("ad-drop", "give plain and at least one"),
        ("plain", "give plain and at least one"),
        ("plain,r-drop,r-drop", "names a method twice"),
    ):
        with pytest.raises(methods.SweepError, match=message):
            methods.parse_methods(text, PROVIDED)


def test_the_installed_plugin_decides_hiddencut_and_drophead():
    pytest.importorskip("fairseq")
    provided = methods.plugin_provides()
    assert PROVIDED <= provided
    for method, needs in (
        ("hiddencut", "hiddencut_label_smoothed_cross_entropy"),
        ("drophead", "--attn-drophead-schedule"),
    ):
        try:
            methods.parse_methods(f"plain,{method}", provided)
            assert needs in provided
        except methods.SweepError:
            assert needs not in provided


def test_method_cells_merge_options_over_defaults_and_name_what_differs():
    cell = methods.method_cell("r-drop", [], 3)
    assert cell == {
        "method": "r-drop",
        "name": "r-drop",
        "args": ["--criterion", "rdrop_label_smoothed_cross_entropy", "--rdrop-alpha", "5"],
    }
    assert methods.method_cell("r-drop", [("--rdrop-alpha", "5")], 3)["name"] == "r-drop"  # the default, spelled out
    three = methods.method_cell("r-drop", [("--rdrop-alpha", "3")], 3)
    assert three["args"][-2:] == ["--rdrop-alpha", "3"] and three["name"] == "r-drop_alpha=3"
    assert methods.method_cell("dropkey", [], 3)["args"] == [
        "--criterion", "label_smoothed_cross_entropy", "--attn-sched-dropout-schedule", "dropkey:0.1",
    ]  # fmt: skip
    assert methods.method_cell("attendout", [("--attendout-dropout-step", "10")], 3)["args"] == [
        "--criterion", "label_smoothed_cross_entropy", "--attendout", "--attendout-dropout-step", "10",
    ]  # fmt: skip
    with pytest.raises(
        methods.SweepError, match="--epochs 1 with ad-drop's --ad-drop-schedule cross-tuning never runs"
    ):
        methods.method_cell("ad-drop", [], 1)
    assert methods.method_cell("ad-drop", [("--ad-drop-schedule", "always")], 1)["name"] == "ad-drop_schedule=always"
    both = methods.method_cell("ad-drop-r-drop", [("--ad-drop-p", "0.5"), ("--rdrop-alpha", "3")], 3)
    assert both["args"] == [
        "--criterion", "ad_drop_rdrop_label_smoothed_cross_entropy", "--rdrop-alpha", "3", "--ad-drop-p", "0.5",
    ]  # fmt: skip
    assert both["name"] == "ad-drop-r-drop_alpha=3_p=0.5"
    with pytest.raises(methods.SweepError, match="--epochs 1 with ad-drop-r-drop's --ad-drop-schedule cross-tuning"):
        methods.method_cell("ad-drop-r-drop", [], 1)


def test_row_names_keep_the_sign_are_short_and_can_be_given():
    """A row is named after the options that differ from the method's defaults, their signs kept and
    the method's flag prefix left out; or by the user (METHOD:ROW=ARGS)."""
    names = [methods.method_cell("r-drop", [("--rdrop-alpha", v)], 3)["name"] for v in ("3", "-3", "1e-3")]
    assert names == ["r-drop_alpha=3", "r-drop_alpha=-3", "r-drop_alpha=1e-3"]
    # ':' would split fairseq-generate's --path (checkpoints joined by os.pathsep): it is left out of names.
    drophead = methods.method_cell("drophead", [("--attn-drophead-schedule", "0:0.1,28:0,56:0.1")], 3)
    assert drophead["name"] == "drophead_schedule=0_0.1,28_0,56_0.1"
    assert methods.method_cell("attendout", [("--attendout-dropout-step", "10")], 3)["name"] == (
        "attendout_dropout-step=10"
    )
    long = methods.method_cell("ad-drop", [("--ad-drop-layers", ",".join(map(str, range(40))))], 3)["name"]
    assert len(long) <= methods.NAME_LIMIT and long.startswith("ad-drop_layers=0,1,2,")

    given = methods.parse_method_args(["drophead:v-shape=--attn-drophead-schedule 0:0.1,28:0,56:0.1"], ["drophead"])
    assert given == {"drophead": methods.MethodArgs("v-shape", [("--attn-drophead-schedule", "0:0.1,28:0,56:0.1")])}
    named = methods.method_cell("drophead", given["drophead"].groups, 3, given["drophead"].row)
    assert named == {**drophead, "name": "v-shape"}  # the same run, under the user's name
    for value, message in (
        ("r-drop:dropkey=--rdrop-alpha 3", "--method-args 'r-drop:dropkey=--rdrop-alpha 3': row name dropkey is "
         "a method's name (its row with its defaults); give another"),
        ("r-drop:a/b=--rdrop-alpha 3", "row name 'a/b' must be 1 to 60 of letters, digits and . _ , + = -, "
         "starting with a letter or digit"),
        ("r-drop:=--rdrop-alpha 3", "row name '' must be 1 to 60 of"),
    ):  # fmt: skip
        with pytest.raises(methods.SweepError, match=re.escape(message)):
            methods.parse_method_args([value], ["plain", "r-drop", "dropkey"])


def test_named_rows_reach_the_report_with_their_options_once(fake, tmp_path):
    out = tmp_path / "cmp"
    extra = ["--method-args", "r-drop:strong=--rdrop-alpha 10", "--method-args", "ad-drop:ad-drop=--ad-drop-p 0.5"]
    argv = fake["argv"](out, *extra, methods="plain,r-drop,ad-drop", seeds="1")
    with pytest.raises(SystemExit):  # ad-drop's own name is its default row
        compare.main(argv)
    argv = fake["argv"](out, *extra[:2], "--method-args", "dropkey:strong=--attn-sched-dropout-schedule dropkey:0.2",
                        methods="plain,r-drop,dropkey", seeds="1")  # fmt: skip
    with pytest.raises(SystemExit):  # two rows of one name
        compare.main(argv)
    assert not out.exists()
    argv = fake["argv"](out, *extra[:2], methods="plain,r-drop,dropkey", seeds="1")
    assert compare.main(argv) == 0
    assert "--rdrop-alpha 10" in _train_line(out, "strong", 1)
    report = (out / "results.md").read_text()
    assert "| strong | 1 |" in report and "- strong: not distinguishable from plain at 1 seed" in report
    listed = [line for line in report.splitlines() if "--rdrop-alpha 10" in line]
    assert listed == ["- strong (r-drop): `--criterion rdrop_label_smoothed_cross_entropy --rdrop-alpha 10`"]


def test_a_row_recorded_under_an_older_name_is_continued_not_retrained(fake, tmp_path, capsys):
    """Rows an earlier version named (r-drop__rdrop-alpha-3) are kept: the same method and options
    continue that row, more seeds included, rather than training a second row of another name."""
    out = tmp_path / "cmp"
    old = fake["argv"](out, "--method-args", "r-drop:r-drop__rdrop-alpha-3=--rdrop-alpha 3", methods="plain,r-drop")
    assert compare.main(old) == 0
    assert fake["calls"]["fairseq-train"] == 4
    capsys.readouterr()
    argv = fake["argv"](out, "--method-args", "r-drop=--rdrop-alpha 3", methods="plain,r-drop", seeds="1,2,3")
    assert compare.main(argv) == 0
    assert fake["calls"]["fairseq-train"] == 6  # seed 3 of plain and of the recorded row, nothing else
    assert f"r-drop_alpha=3: recorded in {out} as r-drop__rdrop-alpha-3" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert {m["name"]: m["seeds"] for m in results["methods"]} == {
        "plain": [1, 2, 3],
        "r-drop__rdrop-alpha-3": [1, 2, 3],
    }
    named = fake["argv"](out, "--method-args", "r-drop:strong=--rdrop-alpha 3", methods="plain,r-drop", seeds="4")
    with pytest.raises(SystemExit):
        compare.main(named)
    assert "names a row strong, but --out-dir" in capsys.readouterr().err and fake["calls"]["fairseq-train"] == 6


@pytest.mark.parametrize(
    "extra, train, message",
    [
        (
            ["--methods", "plain,drophead"],
            None,
            "drophead: the installed plugin has no task option --attn-drophead-schedule; accepted here: plain, ad-drop",
        ),
        (["--methods", "plain,hiddencut"], None, "hiddencut: the installed plugin has no fairseq criterion"),
        (
            ["--methods", "plain,r-drop", "--method-args", "dropkey=--attn-sched-dropout-schedule dropkey:0.2"],
            None,
            "dropkey is not in --methods",
        ),
        (
            ["--methods", "plain,r-drop", "--method-args", "r-drop=--attendout"],
            None,
            "r-drop's options are --rdrop-*; got --attendout",
        ),
        (["--methods", "plain,r-drop", "--method-args", "plain=--dropout 0.3"], None, "plain's options are none"),
        (
            ["--methods", "plain,r-drop", "--method-args", "rdrop=--rdrop-alpha 1"],
            None,
            "expected METHOD=ARGS or METHOD:ROW=ARGS with METHOD one of plain",
        ),
        (
            [],
            ["--arch", "transformer", "--rdrop-alpha", "3"],
            "--rdrop-alpha after '--': the arguments there are every method's",
        ),
        ([], ["--arch", "transformer", "--criterion", "x"], "--criterion after '--'"),
        ([], ["--arch", "transformer", "--seed", "3"], "--seed after '--' are set by the sweep"),
        (["--epochs", "1"], None, "--epochs 1 with ad-drop's --ad-drop-schedule cross-tuning never runs AD-DROP"),
        (["--seeds", "1,1"], None, "--seeds must be a comma list of distinct integers"),
        # numpy's seed range: fairseq-train failed on 2**32 after every other run had trained.
        (["--seeds", "1,4294967296"], None, "--seeds must be a comma list of distinct integers from 0 to 4294967295"),
    ],
)
def test_bad_options_are_refused_before_any_run(fake, tmp_path, capsys, extra, train, message):
    argv = fake["argv"](tmp_path / "o", train=train or ("--arch", "transformer"))
    argv[argv.index("--") : argv.index("--")] = extra  # later options win: --methods, --epochs, --seeds replaced
    with pytest.raises(SystemExit):
        compare.main(argv)
    assert message in capsys.readouterr().err
    assert fake["calls"] == {"fairseq-train": 0, "fairseq-generate": 0} and not (tmp_path / "o").exists()


def test_help_names_no_test_option_and_an_abbreviation_is_refused(fake, tmp_path, capsys):
    """The comparison always translates the test split: it has no --test, and argparse must not read
    one as an abbreviation of --test-ref."""
    help_text = compare.build_mt_compare_parser().format_help()
    assert "--test-ref" in help_text and not re.search(r"--test(?![\w-])", help_text)
    for word in ("--test", "--test-r", "--method"):  # an unknown option, and prefixes of --test-ref, --methods
        argv = fake["argv"](tmp_path / "o")
        argv[argv.index("--") : argv.index("--")] = [word, "x"]
        with pytest.raises(SystemExit):
            compare.main(argv)
        assert f"unrecognized arguments: {word} x" in capsys.readouterr().err
    assert fake["calls"] == {"fairseq-train": 0, "fairseq-generate": 0} and not (tmp_path / "o").exists()


# -- the command on stand-in children -------------------------------------------------------------
def _train_line(out: Path, name: str, seed: int) -> str:
    return (out / "runs" / name / f"seed{seed}" / "train.log").read_text().split("\n", 1)[0]


def test_each_methods_arguments_reach_its_runs_and_results_accumulate(fake, tmp_path, capsys):
    out = tmp_path / "cmp"
    extra = ["--method-args", "ad-drop=--ad-drop-p 0.5 --ad-drop-q 0.5", "--method-args", "r-drop=--rdrop-alpha 3"]
    fake["plan"](
        hyps={"plain/": "drop:3", "ad-drop": "drop:3", "r-drop": "ref", "dropkey": "drop:4", "attendout": "drop:5"}
    )
    assert compare.main(fake["argv"](out, *extra)) == 0
    assert fake["calls"] == {"fairseq-train": 10, "fairseq-generate": 20}  # 5 methods x 2 seeds; valid and test
    ad_drop, r_drop = "ad-drop_p=0.5_q=0.5", "r-drop_alpha=3"
    expected = {
        "plain": "--criterion label_smoothed_cross_entropy --max-epoch 3",
        ad_drop: "--criterion ad_drop_label_smoothed_cross_entropy --ad-drop-p 0.5 --ad-drop-q 0.5 --max-epoch",
        r_drop: "--criterion rdrop_label_smoothed_cross_entropy --rdrop-alpha 3 --max-epoch",
        "dropkey": "--criterion label_smoothed_cross_entropy --attn-sched-dropout-schedule dropkey:0.1 --max-epoch",
        "attendout": "--criterion label_smoothed_cross_entropy --attendout --max-epoch",
    }
    for name, args in expected.items():
        for seed in (1, 2):
            line = _train_line(out, name, seed)
            assert args in line and "--task attn_reg_translation" in line and f"--seed {seed} " in line
    assert "--rdrop" not in _train_line(out, "plain", 1) and "--ad-drop" not in _train_line(out, r_drop, 1)

    results = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in results["methods"]] == ["plain", ad_drop, "attendout", r_drop, "dropkey"]
    by_name = {m["name"]: m for m in results["methods"]}
    assert (
        by_name[r_drop]["metrics"]["test_bleu"]["mean"] == 100.0
        and by_name[r_drop]["metrics"]["test_bleu"]["sd"] == 0.0
    )
    assert by_name[r_drop]["differences"]["test_bleu"]["mean"] > 20  # the references against every 3rd word dropped
    assert by_name[ad_drop]["differences"]["test_bleu"]["mean"] == 0.0  # plain's hypotheses ("drop:3")
    assert by_name[ad_drop]["paired_tests"]["1"]["bleu_p"] < 0.01  # sacrebleu's p for identical output...
    table = (out / "results.md").read_text()
    assert f"| {ad_drop} | 1,2 | +0.00 [+0.00, +0.00] |" in table  # ...is shown as "same", not as a p-value
    assert "| seed 1: same (same), seed 2: same (same) |" in table and "seed 1: 0.001 (0.001), seed 2" in table
    assert "| method − plain | paired seeds |" in table and "Verdicts:" in table and (out / "compare.png").exists()
    assert f"- {ad_drop} (ad-drop): `{expected[ad_drop].removesuffix(' --max-epoch')}`" in table  # as run
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A second command: a third seed for plain and R-Drop only. Nothing recorded is erased or retrained.
    capsys.readouterr()
    assert (
        compare.main(fake["argv"](out, "--method-args", "r-drop=--rdrop-alpha 3", methods="plain,r-drop", seeds="3"))
        == 0
    )
    assert fake["calls"] == {"fairseq-train": 12, "fairseq-generate": 24}
    results = json.loads((out / "results.json").read_text())
    seeds = {m["name"]: m["seeds"] for m in results["methods"]}
    assert seeds == {"plain": [1, 2, 3], ad_drop: [1, 2], r_drop: [1, 2, 3], "dropkey": [1, 2], "attendout": [1, 2]}
    assert json.loads((out / "results.json").read_text())["seeds"] == [1, 2, 3]
    assert f"| {ad_drop} | 1,2 |" in (out / "results.md").read_text()


def test_sacrebleus_paired_test_gets_the_runs_hypotheses_and_its_p_value_is_in_the_table(fake, tmp_path, monkeypatch):
    from sacrebleu import significance

    seen = []
    real = significance.PairedTest

    class Spy(real):
        def __init__(self, named_systems, metrics, references, **kwargs):
            seen.append({"systems": named_systems, "references": references, **kwargs})
            super().__init__(named_systems, metrics, references, **kwargs)

        def __call__(self):
            signatures, scores = super().__call__()
            seen[-1]["p"] = scores["BLEU"][1].p_value
            seen[-1]["chrf_p"] = scores["chrF2"][1].p_value
            return signatures, scores

    monkeypatch.setattr(significance, "PairedTest", Spy)
    out = tmp_path / "cmp"
    fake["plan"](
        hyps={
            "r-drop/seed1/valid": "drop:3",  # valid differs from test: the test split's are the ones compared
            "plain/seed1": "drop:2",
            "plain/seed2": "drop:3",
            "r-drop/seed1": "ref",
            "r-drop/seed2": "drop:3<2",  # the first two sentences right, the rest as plain's
        }  # fmt: skip
    )
    assert compare.main(fake["argv"](out, methods="plain,r-drop")) == 0
    assert len(seen) == 2 and all(s["test_type"] == "bs" and s["n_samples"] == 1000 for s in seen)
    drop2 = [fake_fairseq._hypothesis("drop:2", r) for r in REFS]
    two = [fake_fairseq._hypothesis("drop:3<2", r, i) for i, r in enumerate(REFS)]
    assert two[:2] == REFS[:2] and two[2:] == [fake_fairseq._hypothesis("drop:3", r) for r in REFS[2:]]
    assert seen[0]["systems"] == [("plain", drop2), ("method", REFS)] and seen[0]["references"] == [REFS]
    assert seen[1]["systems"][1] == ("method", two) and seen[1]["references"] == [REFS]
    table = (out / "results.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| r-drop | 1,2 | +"))
    assert round(seen[1]["p"], 3) != round(seen[1]["chrf_p"], 3)  # so that the row shows which is which
    for seed, test in enumerate(seen, 1):
        assert f"seed {seed}: {test['p']:.3f} ({test['chrf_p']:.3f})" in row
    assert seen[0]["p"] < 0.05  # every word against half the words: sacrebleu calls it significant


# -- real fairseq-train runs on the shipped corpus ------------------------------------------------
@pytest.fixture()
def counted_forks(monkeypatch, forked_runs):
    """Counts the fairseq-train and fairseq-generate runs the command starts (forks of the tests' server)."""
    calls = {"fairseq-train": 0, "fairseq-generate": 0}
    real = sweep_runs.run_appended

    def run(cmd, *args, **kwargs):
        calls[cmd[0].rsplit("/", 1)[-1]] += 1
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(sweep_runs, "run_appended", run)
    return calls


def test_a_diverged_method_is_recorded_and_the_others_still_compared(tiny_mt_data, tmp_path, counted_forks, capsys):
    """R-Drop at alpha 1e38 makes fairseq-train raise FloatingPointError at its first update (and its
    NaN-detector replay StopIteration): the run is recorded as diverged, plain and DropKey are compared,
    and the same command again keeps every record and writes the same report."""
    out = tmp_path / "cmp"
    argv = [
        str(tiny_mt_data["bin"]), "--out-dir", str(out), "--methods", "plain,r-drop,dropkey", "--epochs", "1",
        "--seeds", "1", "--method-args", "r-drop=--rdrop-alpha 1e38", "--", *TINY_MT_TRAIN,
    ]  # fmt: skip
    assert compare.main(argv) == 0
    r_drop = methods.method_cell("r-drop", [("--rdrop-alpha", "1e38")], 1)["name"]
    train_log = (out / "runs" / r_drop / "seed1" / "train.log").read_text()
    assert "FloatingPointError: gradients are Nan/Inf" in train_log and "StopIteration" in train_log
    assert counted_forks == {"fairseq-train": 3, "fairseq-generate": 4}  # the diverged run is not translated
    assert f"[cell 2/3] {r_drop} seed 1: DIVERGED: fairseq-train stopped in epoch 1: " in capsys.readouterr().out

    reason = "seed 1: fairseq-train stopped in epoch 1: FloatingPointError: gradients are Nan/Inf"
    results = json.loads((out / "results.json").read_text())
    verdicts = {v.split(": ", 1)[0]: v for v in results["verdicts"]}
    assert verdicts[r_drop] == f"{r_drop}: not compared: diverged ({reason})"
    assert verdicts["dropkey"].startswith("dropkey: not distinguishable from plain at 1 seed (test BLEU ")
    by_name = {m["name"]: m for m in results["methods"]}
    assert by_name[r_drop]["metrics"]["test_bleu"]["mean"] is None and by_name[r_drop]["paired_tests"] == {}
    assert set(by_name["dropkey"]["paired_tests"]) == {"1"}  # plain and DropKey: sacrebleu's test ran
    report = (out / "results.md").read_text()
    assert f"| {r_drop} | 1 | - | - | - | - | diverged ({reason}) |" in report
    assert f"| {r_drop} | - | - | - | - | - | - |" in report  # no paired seed, no difference
    assert f"- {r_drop}: not compared: diverged ({reason})" in report

    # The same command again: nothing trains or translates, and the report is written again.
    (out / "results.md").unlink()
    assert compare.main(argv) == 0
    assert counted_forks == {"fairseq-train": 3, "fairseq-generate": 4}
    assert (out / "results.md").read_text() == report


@pytest.mark.parametrize(
    "method_args, method, refusal",
    [
        ("r-drop=--rdrop-alpha -3", "r-drop", "--rdrop-alpha must be a finite number >= 0, got -3.0"),
        (
            "ad-drop=--ad-drop-layers 5",
            "ad-drop",
            "--ad-drop-layers: layer 5 does not exist; the model's encoder-self attention has 2 layers",
        ),
        # AttendOut's model is built on the CPU (its generator cannot be built on the meta device).
        ("attendout=--attendout --attendout-layers 5", "attendout", "--attendout-layers: layer 5 does not exist"),
    ],
)
def test_every_methods_options_are_checked_before_anything_trains(
    tiny_mt_data, tmp_path, counted_forks, capsys, method_args, method, refusal
):
    """A method's option that the plugin refuses (a value out of range, a layer the model lacks) stops
    the command before plain or any other method trains, naming the method, the option and what it accepts."""
    out = tmp_path / "cmp"
    argv = [
        str(tiny_mt_data["bin"]), "--out-dir", str(out), "--methods", "plain,r-drop,ad-drop,attendout",
        "--epochs", "2", "--method-args", method_args, "--", *TINY_MT_TRAIN,
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        compare.main(argv)
    err = capsys.readouterr().err
    given = methods.parse_method_args([method_args], [method])[method]
    name = methods.method_cell(method, given.groups, 2, given.row)["name"]
    what = f"{name} ({method})" if name != method else name
    assert f"attn-reg-mt-compare: error: {what} would stop before training, refused by fairseq-train: {refusal}" in err
    assert counted_forks == {"fairseq-train": 0, "fairseq-generate": 0} and not out.exists()


# -- statistics and verdicts on hand-made records -------------------------------------------------
def _run(seed, valid_bleu, test_bleu, chrf, loss):
    return {
        "seed": seed, "valid_bleu": valid_bleu, "test_bleu": test_bleu, "valid_loss": loss, "final_valid_loss": loss,
        "test": {"chrf": chrf}, "valid": {"length_ratio": 1.0, "empty_hypotheses": 0}, "ad_drop_rate": None,
        "ad_drop_skipped": None, "diverged": None, "missing_epochs": [], "train_seconds": 1.0,
    }  # fmt: skip


def _record(name, rows):
    cell = {"method": name.split("_")[0], "name": name, "args": []}
    return summarize(cell, [_run(*row) for row in rows], {})


def test_t_quantiles_are_students():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 9, 30, 31, 60, 200):
        assert paired.t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4)


def test_table_means_spreads_and_intervals_by_hand(tmp_path, monkeypatch):
    monkeypatch.setattr(compare_report, "paired_tests", lambda *a: {})
    plain = _record("plain", [(1, 20.0, 29.0, 50.0, 4.00), (2, 21.0, 30.5, 51.0, 4.10), (3, 22.0, 31.0, 52.0, 4.20)])
    method = _record("r-drop", [(1, 21.0, 30.0, 50.5, 3.95), (2, 21.0, 31.0, 51.5, 4.05), (3, 23.0, 32.5, 52.5, 4.10)])
    one = _record("dropkey", [(1, 19.0, 28.0, 49.0, 4.05)])
    summaries = [compare_report.mt_row_summary(r, plain, tmp_path, "13a") for r in (plain, method, one)]
    d = summaries[1]["differences"]["test_bleu"]
    # differences 1.0, 0.5, 1.5: mean 1, sample sd 0.5, half width 4.303 x 0.5 / sqrt(3) = 1.2422
    assert (
        d["per_seed"] == {1: 1.0, 2: 0.5, 3: 1.5} and d["mean"] == pytest.approx(1.0) and d["sd"] == pytest.approx(0.5)
    )
    assert d["ci"] == pytest.approx([1.0 - 1.24217, 1.0 + 1.24217], abs=1e-4)
    loss = summaries[1]["differences"]["valid_loss"]  # -0.05, -0.05, -0.10: mean -0.0667, sd 0.02887, half 0.0717
    assert loss["mean"] == pytest.approx(-0.066667, abs=1e-5) and loss["ci"] == pytest.approx(
        [-0.13838, 0.00505], abs=1e-4
    )
    assert summaries[1]["metrics"]["test_bleu"]["sd"] == pytest.approx(
        math.sqrt(((30 - 31.1667) ** 2 + (31 - 31.1667) ** 2 + (32.5 - 31.1667) ** 2) / 2), abs=1e-4
    )
    lines = compare_report.tables(summaries)
    assert "| r-drop | 1,2,3 | 21.67 ± 1.15 | 31.17 ± 1.26 | 51.50 ± 1.00 | 4.033 ± 0.076 |  |" in lines
    assert "| dropkey | 1 | 19.00 ± n/a | 28.00 ± n/a | 49.00 ± n/a | 4.050 ± n/a |  |" in lines
    assert (
        "| r-drop | 1,2,3 | +0.67 [-0.77, +2.10] | +1.00 [-0.24, +2.24] | +0.50 [+0.50, +0.50] | -0.067 [-0.138, +0.005] | - |"
        in lines
    )
    assert "| dropkey | 1 | -1.00 n/a | -1.00 n/a | -1.00 n/a | +0.050 n/a | - |" in lines


def test_every_text_of_compare_png_is_inside_the_figure(tmp_path, monkeypatch):
    """Panel titles, the figure's title and the method names under the axes are drawn whole: none
    runs past the figure's edge (the third panel's title once did)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    monkeypatch.setattr(compare_report, "paired_tests", lambda *a: {})
    names = ["plain", "ad-drop_p=0.5_q=0.5", "r-drop_alpha=3", "drophead_schedule=0_0.1,28_0,56_0.1", "dropkey"]
    names += ["attendout", "hiddencut", "ad-drop-r-drop_alpha=3_p=0.5"]
    records = [
        _record(name, [(1, 20.0, 29.0 + i, 50.0, 4.0), (2, 21.0, 30.0, 51.0, 4.1)]) for i, name in enumerate(names)
    ]
    summaries = [compare_report.mt_row_summary(r, records[0], tmp_path, "13a") for r in records]
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure draw() saved, to measure it
    title = "Regularizers against plain, en→ro, 60 epochs, seeds 1,2,3,4,5"
    assert compare_report.draw_mt_comparison(summaries, tmp_path / "compare.png", title, print) == str(
        tmp_path / "compare.png"
    )
    (fig,) = drawn
    renderer = fig.canvas.get_renderer()
    width, height = fig.canvas.get_width_height()
    texts = [fig._suptitle] + [t for ax in fig.axes for t in [ax.title, *ax.get_xticklabels(), *ax.get_yticklabels()]]
    texts = [t for t in texts if t is not None and t.get_text()]
    assert len(texts) > 3 * len(names)
    outside = []
    for text in texts:
        box = text.get_window_extent(renderer)
        if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5:
            outside.append(text.get_text())
    assert outside == []


def test_compare_png_says_where_a_row_diverged(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    monkeypatch.setattr(compare_report, "paired_tests", lambda *a: {})
    plain = _record("plain", [(1, 20.0, 29.0, 50.0, 4.0)])
    stopped = {**_run(1, None, None, None, None), "test": None, "valid": None, "diverged": "fairseq-train stopped"}
    diverged = summarize({"method": "r-drop", "name": "r-drop", "args": []}, [stopped], {})
    summaries = [compare_report.mt_row_summary(r, plain, tmp_path, "13a") for r in (plain, diverged)]
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    compare_report.draw_mt_comparison(summaries, tmp_path / "compare.png", "t", print)
    (fig,) = drawn
    notes = [[t.get_text() for t in ax.texts] for ax in fig.axes]
    assert notes == [["diverged"], ["diverged"], ["diverged"]]


def _diffs(bleu, loss):
    return {"test_bleu": paired.paired_difference(*bleu), "valid_loss": paired.paired_difference(*loss)}


def _tests(*ps, better=True):
    return {i + 1: {"bleu_p": p, "bleu": 31.0 if better else 29.0, "bleu_plain": 30.0} for i, p in enumerate(ps)}


def test_verdict_sentences():
    plain_b, plain_l = {1: 30.0, 2: 30.5, 3: 29.5}, {1: 4.0, 2: 4.1, 3: 4.2}
    better = _diffs(({1: 32.0, 2: 32.4, 3: 31.7}, plain_b), ({1: 4.0, 2: 4.1, 3: 4.2}, plain_l))
    text = paired.verdict("r-drop", better, _tests(0.001, 0.2, 0.01), [])
    assert text.startswith("r-drop: better: test BLEU +2.03 [") and text.endswith(
        "at 3 seeds, and sacrebleu's paired test (p < 0.05) agrees at 2 of 3 seed(s)"
    )
    noise = _diffs(({1: 30.6, 2: 30.1, 3: 29.9}, plain_b), ({1: 4.05, 2: 4.05, 3: 4.25}, plain_l))
    text = paired.verdict("dropkey", noise, _tests(0.04, 0.5, 0.6), [])
    assert text.startswith("dropkey: not distinguishable from plain at 3 seeds (test BLEU +0.20 [")
    assert text.endswith(
        "; sacrebleu's paired test calls 1 of 3 seed(s) significant (p < 0.05), but the seeds do not: a per-seed "
        "test alone over-claims"
    )
    # Equal scores: sacrebleu's bootstrap returns p = 1/1001 there, which is no difference at all.
    same = {seed: {"bleu_p": 1 / 1001, "bleu": 30.0, "bleu_plain": 30.0} for seed in (1, 2, 3)}
    assert "significant" not in paired.verdict("dropkey", noise, same, [])
    assert paired.verdict("r-drop", better, same, []).endswith("agrees at 0 of 3 seed(s)")
    loss_only = _diffs(({1: 30.5, 2: 30.0, 3: 29.8}, plain_b), ({1: 3.96, 2: 4.05, 3: 4.16}, plain_l))
    text = paired.verdict("ad-drop", loss_only, _tests(0.3, 0.4, 0.5), [])
    assert text.startswith("ad-drop: better on valid loss at every seed (best valid loss -0.043 [")
    assert "BLEU within noise (test BLEU +0.10 [" in text and text.endswith("at 3 seeds")
    # Lower loss at 4 of 5 seeds, its interval below 0: better on valid loss, not "at every seed".
    five_b, five_l = dict.fromkeys(range(1, 6), 30.0), dict.fromkeys(range(1, 6), 4.0)
    loss_most = _diffs(({**five_b, 1: 30.4}, five_b), ({1: 3.9, 2: 3.9, 3: 3.9, 4: 3.9, 5: 4.01}, five_l))
    text = paired.verdict("ad-drop", loss_most, {}, [])
    assert text.startswith("ad-drop: better on valid loss (best valid loss -0.078 [-0.139, -0.017])")
    one = _diffs(({1: 31.0}, plain_b), ({1: 3.9}, plain_l))
    assert paired.verdict("attendout", one, _tests(0.01), []) == (
        "attendout: not distinguishable from plain at 1 seed (test BLEU +1.00 (one seed, no interval); no seed "
        "spread, add seeds); sacrebleu's paired test at seed 1: p 0.010, which alone over-claims"
    )
    worse = _diffs(({1: 28.0, 2: 28.4, 3: 27.7}, plain_b), ({1: 4.0, 2: 4.1, 3: 4.2}, plain_l))
    assert paired.verdict("x", worse, _tests(0.01, 0.01, 0.01, better=False), []).startswith(
        "x: worse: test BLEU -1.97 ["
    )
    assert paired.verdict("x", better, {}, ["diverged (seed 1: ...)"]) == "x: not compared: diverged (seed 1: ...)"
    notes = paired.cautions({"name": "x", "length_ratio": 1.4}, {"name": "plain", "length_ratio": 1.0}, 0.5)
    assert notes == [
        "plain's test BLEU is 0.50: the models do not translate yet, BLEU says little",
        "x's hypotheses are 1.40 x the references' length: degenerate output, BLEU says little",
    ]
    assert paired.verdict("x", better, {}, [], notes).endswith("; " + "; ".join(notes))
    assert paired.cautions({"name": "x", "length_ratio": 1.2}, {"name": "plain", "length_ratio": 0.9}, 20.0) == []


def test_a_method_that_never_acted_or_a_diverged_plain_is_not_compared(fake, tmp_path):
    fake["plan"](cells={"ad-drop": {"ad_drop_skipped": [10, 10, 10]}})
    assert compare.main(fake["argv"](tmp_path / "a", methods="plain,ad-drop,r-drop", seeds="1")) == 0
    verdicts = json.loads((tmp_path / "a" / "results.json").read_text())["verdicts"]
    assert verdicts[0].startswith("ad-drop: not compared: AD-DROP skipped in 100% of its steps")
    assert verdicts[1].startswith("r-drop: not distinguishable from plain at 1 seed")
    fake["plan"](cells={"plain": {"valid_loss": [50.0, 60.0, 70.0]}})
    assert compare.main(fake["argv"](tmp_path / "b", methods="plain,r-drop", seeds="1")) == 0
    (verdict,) = json.loads((tmp_path / "b" / "results.json").read_text())["verdicts"]
    assert verdict.startswith("r-drop: not compared: plain diverged (seed 1: valid loss 50 at epoch 1")


# -- a run's identity, failed runs, an earlier command's jobs (stand-in children and launcher) -----
def test_a_run_started_with_other_arguments_is_refused_naming_both(fake, tmp_path, capsys):
    """A named row stopped after training, before scoring (here its translation fails), then the same
    row with another alpha: refused before anything runs, naming both command lines (it was scored
    as trained with the new alpha). The same arguments again score it without training it again."""
    out = tmp_path / "cmp"
    fake["plan"](fail=["myrow/seed1/valid"])
    first = fake["argv"](out, "--method-args", "r-drop:myrow=--rdrop-alpha 1", methods="plain,r-drop", seeds="1")
    with pytest.raises(RuntimeError, match="fairseq-generate failed"):
        compare.main(first)
    seed_dir = out / "runs" / "myrow" / "seed1"
    assert (seed_dir / "trained.json").exists() and not (seed_dir / "result.json").exists()
    assert fake["calls"]["fairseq-train"] == 2
    fake["plan"]()
    capsys.readouterr()
    other = fake["argv"](out, "--method-args", "r-drop:myrow=--rdrop-alpha 3", methods="plain,r-drop", seeds="1")
    with pytest.raises(SystemExit) as stop:
        compare.main(other)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert f"{seed_dir} was started with other fairseq-train arguments (1 then, 3 now): it was `" in err
    assert "--rdrop-alpha 1 --max-epoch 3" in err and "--rdrop-alpha 3 --max-epoch 3" in err
    assert fake["calls"] == {"fairseq-train": 2, "fairseq-generate": 3} and not (seed_dir / "result.json").exists()
    assert compare.main(first) == 0
    assert fake["calls"]["fairseq-train"] == 2  # trained earlier: only scored
    assert json.loads((seed_dir / "result.json").read_text())["cell"]["args"][-2:] == ["--rdrop-alpha", "1"]


class LocalJob:
    """A submitit job of :class:`InProcessExecutor`: run at once, in this process (the stand-in
    children's monkeypatches hold); its Python error in its log, as submitit writes it."""

    def __init__(self, folder: Path, index: int, fn, args, run: bool):
        self.job_id, self.state = f"990{index}_0", "PENDING"
        self.paths = type("Paths", (), {"stderr": folder / f"{index}_0_log.err"})
        folder.mkdir(parents=True, exist_ok=True)
        if run:
            try:
                fn(*args)
                self.state, log = "COMPLETED", ""
            except Exception as e:
                self.state, log = "FAILED", f"Traceback (most recent call last):\n{type(e).__name__}: {e}\n"
            self.paths.stderr.write_text(log)

    def done(self):
        return self.state != "PENDING"

    def get_info(self, mode="standard"):
        return {"State": self.state}

    def cancel(self, check=True):
        self.state = "CANCELLED"


class SlurmJob(LocalJob):
    """A Slurm job that stays queued (an earlier command's, still PENDING for sacct)."""


class InProcessExecutor:
    """submitit's executors in the launcher's place: local jobs run at once; Slurm jobs stay queued."""

    def __init__(self, opts):
        self.folder, self.slurm, self.jobs = opts.out_dir / "jobs", opts.launcher == "slurm", []

    def batch(self):
        import contextlib

        return contextlib.nullcontext()

    def submit(self, fn, *args):
        job = (SlurmJob if self.slurm else LocalJob)(self.folder, len(self.jobs), fn, args, not self.slurm)
        self.jobs.append(job)
        return job


@pytest.fixture()
def stand_in_launcher(monkeypatch, tmp_path):
    """The launcher's executor in this process, and a ``sacct`` on PATH that says each job PENDING."""
    from attn_reg_plugin.sweep import launcher

    monkeypatch.setattr(launcher, "_executor", InProcessExecutor)
    monkeypatch.setattr("os.cpu_count", lambda: 4)  # --jobs 2 on any machine
    sacct = tmp_path / "slurm-bin" / "sacct"
    sacct.parent.mkdir()
    script = 'import sys\nids = [a for i, a in enumerate(sys.argv) if sys.argv[i - 1] == "-j"]\n'
    script += 'print("JobID|State|NodeList")\nprint("\\n".join(f"{i}_0|PENDING|" for i in ids))\n'
    sacct.write_text(f"#!{sys.executable}\n{script}")
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sacct.parent}{os.pathsep}{os.environ['PATH']}")


def test_failed_runs_are_named_and_each_comparison_says_what_it_lacks(fake, tmp_path, stand_in_launcher):
    """--jobs 2: every plain run fails (it crashed the report in the paired statistics), then only
    DropKey's seed 2: the results are written each time, the failed runs named, and each verdict
    says which of its runs is missing."""
    out = tmp_path / "cmp"
    fake["plan"](fail=["plain/", "dropkey/seed2/train"])
    argv = fake["argv"](out, "--jobs", "2", methods="plain,r-drop,dropkey", seeds="1,2")
    assert compare.main(argv) == 1
    results = json.loads((out / "results.json").read_text())
    failed = [(f["name"], f["seed"], f["state"]) for f in results["failed_runs"]]
    assert sorted(failed) == [("dropkey", 2, "FAILED"), ("plain", 1, "FAILED"), ("plain", 2, "FAILED")]
    assert all(f["error"].startswith("RuntimeError: the stand-in fairseq-train fails") for f in results["failed_runs"])
    verdicts = {v.split(": ", 1)[0]: v for v in results["verdicts"]}
    plain_1 = next(f for f in results["failed_runs"] if f["name"] == "plain" and f["seed"] == 1)
    assert verdicts["r-drop"].startswith(
        f"r-drop: not compared: plain's run at seed 1 failed (job {plain_1['job']}, FAILED): seed 1 is not compared; "
        "plain's run at seed 2 failed"
    )
    assert "dropkey's run at seed 2 failed" in verdicts["dropkey"]
    report = (out / "results.md").read_text()
    assert f"- plain seed 1: job {plain_1['job']} FAILED: RuntimeError: the stand-in" in report
    assert [m["name"] for m in results["methods"]] == ["r-drop", "dropkey"] and (out / "compare.png").exists()

    fake["plan"](fail=["dropkey/seed2/train"])
    assert compare.main(argv) == 1  # plain's runs again, and DropKey's seed 2, which fails again
    results = json.loads((out / "results.json").read_text())
    verdicts = {v.split(": ", 1)[0]: v for v in results["verdicts"]}
    assert verdicts["r-drop"].startswith("r-drop: not distinguishable from plain at 2 seeds")
    assert "failed" not in verdicts["r-drop"]
    assert verdicts["dropkey"].startswith("dropkey: not distinguishable from plain at 1 seed")
    assert (
        verdicts["dropkey"].endswith(": seed 2 is not compared")
        and "dropkey's run at seed 2 failed" in verdicts["dropkey"]
    )


class TimedOutJob(SlurmJob):
    """A Slurm job ended at its time limit with its requeues spent: submitit's last words in its log,
    FAILED for sacct (its run never wrote result.json)."""

    def __init__(self, folder: Path, index: int, fn, args, run: bool):
        super().__init__(folder, index, fn, args, run=False)
        self.state = "FAILED"
        self.paths.stderr.write_text(
            "submitit WARNING (2026-11-28 04:03:58,091) - Caught signal SIGUSR2 on vm: this job is timed-out.\n"
            "submitit INFO (2026-11-28 04:04:00,101) - Job not requeued because: timed-out too many times.\n"
        )


class TimingOutExecutor(InProcessExecutor):
    def submit(self, fn, *args):
        self.jobs.append(TimedOutJob(self.folder, len(self.jobs), fn, args, False))
        return self.jobs[-1]


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_a_comparison_whose_runs_all_failed_writes_results_naming_them(
    fake, tmp_path, stand_in_launcher, monkeypatch, launcher
):
    """Every run failed (issue item 13: each at a one-minute Slurm limit with --slurm-max-requeues 0,
    named TIMEOUT on the console; or, locally, fairseq-train failed): results.json still names each
    in failed_runs (row, seed, state, log), results.md says no run finished and names them, and the
    command exits 1 with one line saying so."""
    from attn_reg_plugin.sweep import launcher as sweep_launcher

    out = tmp_path / "cmp"
    if launcher == "slurm":
        monkeypatch.setattr(sweep_launcher, "_executor", TimingOutExecutor)
        extra, state = ["--launcher", "slurm", "--slurm-time", "1", "--slurm-max-requeues", "0"], "TIMEOUT"
    else:
        fake["plan"](fail=["/train"])
        extra, state = ["--jobs", "2"], "FAILED"
    lines = []
    assert compare.main(fake["argv"](out, *extra, methods="plain,dropkey", seeds="1,2"), log=lines.append) == 1
    results = json.loads((out / "results.json").read_text())
    failed = sorted((f["name"], f["seed"], f["state"].split()[0]) for f in results["failed_runs"])
    assert failed == [(name, seed, state) for name in ("dropkey", "plain") for seed in (1, 2)]
    assert all(Path(f["log"]).exists() for f in results["failed_runs"])
    assert results["methods"] == [] and results["settings"]["command"] == "attn-reg-mt-compare"
    report = (out / "results.md").read_text()
    assert "No run finished: all 4 run(s) of this command failed, so nothing is compared." in report
    for f in results["failed_runs"]:
        assert f"- {f['name']} seed {f['seed']}: job {f['job']} {f['state']}: {f['error']}; log {f['log']}" in report
    if launcher == "slurm":
        assert results["failed_runs"][0]["state"] == "TIMEOUT (after 0 requeue(s) at the 1-minute limit)"
    assert lines[-1] == (
        f"no run finished: all 4 run(s) failed; {out / 'results.md'} and results.json name them, "
        "and the same command again submits them"
    ), lines


def test_runs_an_earlier_commands_slurm_jobs_hold_are_neither_run_again_nor_rerun_otherwise(
    fake, tmp_path, stand_in_launcher, capsys
):
    """--launcher slurm --detach, its jobs still queued: the same command with --launcher local is
    refused naming them (it trained them a second time into the same folders), and so is one that
    would run a queued row with other arguments (its job would have scored that row's old ones)."""
    out = tmp_path / "cmp"
    row = ["--method-args", "r-drop:myrow=--rdrop-alpha 1"]
    assert (
        compare.main(fake["argv"](out, *row, "--launcher", "slurm", "--detach", methods="plain,r-drop", seeds="1")) == 0
    )
    jobs = json.loads((out / "jobs.json").read_text())
    assert sorted(jobs) == ["myrow/seed1", "plain/seed1"]
    capsys.readouterr()
    for extra in ([], ["--jobs", "2"]):
        with pytest.raises(SystemExit) as stop:
            compare.main(fake["argv"](out, *row, *extra, methods="plain,r-drop", seeds="1"))
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "--launcher local: 2 of this command's run(s) are Slurm jobs an earlier command submitted" in err
        assert (
            f"myrow/seed1 (job {jobs['myrow/seed1']}, PENDING), plain/seed1 (job {jobs['plain/seed1']}, PENDING)" in err
        )
    other = ["--method-args", "r-drop:myrow=--rdrop-alpha 3", "--launcher", "slurm"]
    with pytest.raises(SystemExit):
        compare.main(fake["argv"](out, *other, methods="plain,r-drop", seeds="1"))
    assert "seed1 was started with other fairseq-train arguments (1 then, 3 now)" in capsys.readouterr().err
    assert fake["calls"] == {"fairseq-train": 0, "fairseq-generate": 0}
    assert json.loads((out / "jobs.json").read_text()) == jobs


def test_a_method_whose_epochs_are_read_from_its_flags_refuses_a_value_of_the_wrong_type():
    """The planned epochs are checked against the method's config, built from its flags: a value the config's
    field cannot take is refused there, naming the flag, before any run."""
    with pytest.raises(methods.SweepError, match="argument --ad-drop-p: invalid float value: 'abc'"):
        methods.method_cell("ad-drop", [("--ad-drop-p", "abc")], 2)
    assert methods.method_cell("ad-drop", [("--ad-drop-schedule", "always")], 1)["name"] == "ad-drop_schedule=always"
    assert methods.method_cell("r-drop", [], 1)["name"] == "r-drop"  # no epoch bound
