"""attn-reg-mt-sweep on a tiny TR->EN-shaped data-bin: the grid over the user's own fairseq-train
arguments, valid-only scoring (sacrebleu on detokenized output), resume after a kill, refusal of
other settings, the table, JSON and heatmap labelled with the pair that was trained."""

import json
import random

import pytest

from attn_reg_plugin import sweep
from attn_reg_plugin.sweep import runs as sweep_runs  # where the runs look up what the tests replace
from helpers import TINY_TRANSFORMER

# A made-up Turkish-like language: each English word has one Turkish-looking counterpart; a
# sentence is translated word by word, the verb moved to the end (subject-object-verb).
_NOUNS = {
    "cat": "kedi", "dog": "köpek", "house": "ev", "water": "su", "book": "kitap", "child": "çocuk",
    "teacher": "öğretmen", "city": "şehir", "road": "yol", "bread": "ekmek", "tree": "ağaç", "door": "kapı",
    "window": "pencere", "friend": "arkadaş", "letter": "mektup", "school": "okul", "garden": "bahçe",
    "apple": "elma", "table": "masa", "sea": "deniz",
}  # fmt: skip
_ADJECTIVES = {
    "big": "büyük", "small": "küçük", "red": "kırmızı", "old": "eski", "new": "yeni", "beautiful": "güzel",
    "cold": "soğuk", "white": "beyaz",
}  # fmt: skip
_VERBS = {
    "sees": "görüyor", "reads": "okuyor", "wants": "istiyor", "likes": "seviyor", "opens": "açıyor",
    "brings": "getiriyor", "finds": "buluyor", "writes": "yazıyor",
}  # fmt: skip
_TIMES = {"today": "bugün", "now": "şimdi", "again": "yine", "tomorrow": "yarın"}


def _pair(rng):
    subject, obj = rng.sample(sorted(_NOUNS), 2)
    adjective, verb, time = rng.choice(sorted(_ADJECTIVES)), rng.choice(sorted(_VERBS)), rng.choice(sorted(_TIMES))
    en = f"the {adjective} {subject} {verb} the {obj} {time}."
    tr = f"{_ADJECTIVES[adjective].capitalize()} {_NOUNS[subject]} {_TIMES[time]} {_NOUNS[obj]}i {_VERBS[verb]}."
    return tr, en


@pytest.fixture(scope="module")
def tiny_tr_en(tmp_path_factory):
    """120/30/30 made-up TR-EN pairs, prepared by attn-reg-prepare as tr -> en."""
    from attn_reg_plugin.prepare import prepare

    root = tmp_path_factory.mktemp("tiny_tr_en")
    raw = root / "raw"
    raw.mkdir()
    rng = random.Random(0)
    for split, n in {"train": 120, "valid": 30, "test": 30}.items():
        pairs = [_pair(rng) for _ in range(n)]
        (raw / f"{split}.tr").write_text("".join(tr + "\n" for tr, _ in pairs), encoding="utf-8")
        (raw / f"{split}.en").write_text("".join(en + "\n" for _, en in pairs), encoding="utf-8")
    data_bin = prepare(
        "tr", "en", {s: raw / s for s in ("train", "valid", "test")}, root / "prep", vocab_size=100, log=lambda s: None
    )
    return {"raw": raw, "bin": data_bin, "root": root}


TRAIN_ARGS = [
    *TINY_TRANSFORMER,
    "--label-smoothing", "0.1", "--dropout", "0.1", "--optimizer", "adam", "--lr", "1e-3",
    "--max-tokens", "500", "--cpu",
]  # fmt: skip


def _argv(data, out, *extra, p="0.2", train_args=TRAIN_ARGS):
    return [
        str(data["bin"]), "--out-dir", str(out), "--p", p, "--q", "0.3", "--schedule", "always", "--epochs", "1",
        "--seeds", "1", "--valid-ref", str(data["raw"] / "valid"), *extra, "--", *train_args,
    ]  # fmt: skip


@pytest.fixture()
def counted(monkeypatch, forked_runs):
    """Counts the fairseq-train and fairseq-generate processes the sweep starts (forks of the tests' server)."""
    calls = {"fairseq-train": 0, "fairseq-generate": 0}
    real = sweep_runs.run_appended

    def run(cmd, *args, **kwargs):
        name = cmd[0].rsplit("/", 1)[-1]
        calls[name] += 1
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(sweep_runs, "run_appended", run)
    return calls


def test_sweep_over_a_tr_en_run_resumes_and_refuses_other_settings(tiny_tr_en, tmp_path, monkeypatch, counted, capsys):
    out = tmp_path / "sweep"
    # Killed after the first run trained, before it was scored.
    real_score = sweep.translate_and_score
    monkeypatch.setattr(sweep_runs, "translate_and_score", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert sweep.main(_argv(tiny_tr_en, out)) == 130  # 128 + SIGINT, as a shell reports an interrupted command
    assert counted == {"fairseq-train": 1, "fairseq-generate": 0}
    assert (
        not list((out / "cells").iterdir())
        and (out / "runs" / "p0.2_q0.3_ga_layers-all_always" / "seed1" / "trained.json").exists()
    )
    monkeypatch.setattr(sweep_runs, "translate_and_score", real_score)

    # Rerun with a second p and the plain reference: the trained run is scored, not retrained.
    argv = _argv(tiny_tr_en, out, "--plain", p="0.2,0.5")
    capsys.readouterr()
    assert sweep.main(argv) == 0
    assert counted == {"fairseq-train": 3, "fairseq-generate": 3}  # plain and p=0.5 trained; all three scored
    printed = capsys.readouterr().out

    cell_a, cell_b = "p0.2_q0.3_ga_layers-all_always", "p0.5_q0.3_ga_layers-all_always"
    train_log = (out / "runs" / cell_b / "seed1" / "train.log").read_text()
    assert "--source-lang tr --target-lang en --criterion ad_drop_label_smoothed_cross_entropy" in train_log
    assert (
        "--ad-drop-p 0.5 --ad-drop-q 0.3 --ad-drop-attribution ga --ad-drop-layers all --ad-drop-schedule always"
        in train_log
    )
    assert "--max-epoch 1 --seed 1" in train_log and "--arch transformer" in train_log
    plain_log = (out / "runs" / "plain" / "seed1" / "train.log").read_text()
    assert "--criterion label_smoothed_cross_entropy" in plain_log and "--ad-drop" not in plain_log
    assert "--gen-subset valid" in (out / "runs" / cell_a / "seed1" / "generate-valid.log").read_text()
    assert not list((out / "runs").glob("*/seed1/generate-test.log"))  # test is never translated without --test

    results = json.loads((out / "results.json").read_text())
    assert results["pair"] == "tr-en" and results["direction"] == "tr→en"
    assert [c["name"] for c in results["cells"]] == ["plain", cell_a, cell_b]
    for c in results["cells"]:
        (run,) = c["runs"]
        assert 0 <= c["valid_bleu"] <= 100 and c["valid_loss"] > 0 and c["seeds"] == [1]
        assert run["valid"]["sentences"] == 30 and run["valid"]["reference"].endswith("raw/valid.en")
        assert "tok:13a" in run["valid"]["sacrebleu"] and run["test_bleu"] is None
    rates = {c["name"]: c["ad_drop_rate"] for c in results["cells"]}
    assert rates["plain"] is None and 0 < rates[cell_a] < rates[cell_b] < 1  # p 0.5 has more candidates
    ad_drop = results["cells"][1:]
    expected = max(ad_drop, key=lambda c: (c["valid_bleu"], -c["valid_loss"]))
    assert results["best"]["name"] == expected["name"] and results["plain"]["name"] == "plain"
    hyps = (out / "runs" / cell_a / "seed1" / "valid.hyp").read_text(encoding="utf-8").split("\n")
    assert len(hyps) == 31 and "▁" not in "".join(hyps)  # detokenized: no sentencepiece marks

    table = (out / "results.md").read_text(encoding="utf-8")
    assert table.startswith("AD-DROP p x q sweep, tr→en, 1 epoch, seeds 1")
    assert f"| {cell_b} |" in table and f"best on valid: {expected['name']}" in table and "raw/valid.en" in table
    everything = table + printed + json.dumps(results, ensure_ascii=False)
    assert not [bad for bad in ("en-ro", "en→ro", "ro-en", "ro→en", ".ro") if bad in everything.lower()]
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[cell 2/3] p0.2_q0.3_ga_layers-all_always seed 1: kept" not in printed  # trained, then scored now

    # The same command again: every cell kept, nothing trained or translated.
    kept = {p.name: p.read_text() for p in (out / "cells").iterdir()}
    assert sweep.main(argv) == 0
    assert counted == {"fairseq-train": 3, "fairseq-generate": 3}
    assert all((out / "cells" / name).read_text() == text for name, text in kept.items())
    assert capsys.readouterr().out.count(": kept from") == 3

    # Other epochs or other fairseq-train arguments: refused, naming what differs, before any run.
    for changed, what in (
        (_argv(tiny_tr_en, out, "--plain", "--epochs", "2", p="0.2,0.5"), "epochs: 1 then, 2 now"),
        (_argv(tiny_tr_en, out, p="0.2", train_args=[*TRAIN_ARGS, "--lr", "5e-4"]), "train_args"),
    ):
        with pytest.raises(SystemExit):
            sweep.main(changed)
        assert what in capsys.readouterr().err
    assert counted == {"fairseq-train": 3, "fairseq-generate": 3}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--p": "0.2,1.0"}, "--p must be a comma list of distinct numbers in the open interval (0, 1), got '0.2,1.0'"),
        ({"--q": "0"}, "--q must be a comma list of distinct numbers in the open interval (0, 1), got '0'"),
        ({"--epochs": "0"}, "--epochs must be an integer >= 1, got 0"),
        ({"--schedule": "cross-tuning"}, "--epochs 1 with --schedule cross-tuning never runs AD-DROP"),
        ({"--schedule": "odd"}, "--schedule must be a comma list of cross-tuning, always, got 'odd'"),
        ({"--attribution": "shap"}, "--attribution must be a comma list of ga, iga, aa, rd, got 'shap'"),
        ({"--layers": "first"}, "--layers must be a ';'-separated list of distinct --ad-drop-layers values"),
        ({"--seeds": "1,x"}, "--seeds must be a comma list of distinct integers from 0 to 4294967295"),
        ({"--post-process": "bpe"}, "--post-process must be one of 'sentencepiece'"),
        ({"--max-len-a": "-1"}, "--max-len-a must be a finite number >= 0, got -1"),
        ({"--max-len-b": "0"}, "--max-len-b must be an integer >= 1, got 0"),
        ({"--source-lang": "de", "--target-lang": "en"}, "--source-lang de: DATA_BIN"),
        ({"--source-lang": "tr"}, "--source-lang and --target-lang go together"),
        ({"--valid-ref": "/nonexistent/valid"}, "--valid-ref /nonexistent/valid: no such file /nonexistent/valid.en"),
        ({"--test": None, "--test-ref": "/x/test", "--": ["--arch", "transformer"]}, None),
        ({"--": ["--seed", "3", "--arch", "transformer"]}, "--seed after '--' are set by the sweep for each run"),
        ({"--": ["--save-dir=x", "--arch", "transformer"]}, "--save-dir after '--' are set by the sweep"),
        (
            {"--": ["--task", "translation", "--arch", "transformer"]},
            "the sweep trains with --task attn_reg_translation",
        ),
        ({"--": ["--lr", "1e-3"]}, "give your fairseq-train arguments after '--', at least --arch"),
        (
            {"--": [*TRAIN_ARGS, "--no-such-flag"]},
            "do not parse for the ad-drop runs: fairseq-train: error: unrecognized arguments: --no-such-flag",
        ),
    ],
)
def test_bad_options_are_refused_before_any_run(tiny_tr_en, tmp_path, counted, capsys, change, message):
    options = {"--p": "0.2", "--q": "0.3", "--schedule": "always", "--epochs": "1", "--out-dir": str(tmp_path / "o")}
    options.update({k: v for k, v in change.items() if k != "--"})
    argv = [str(tiny_tr_en["bin"])]
    for k, v in options.items():
        argv += [k] if v is None else [k, v]
    argv += ["--", *change.get("--", TRAIN_ARGS)]
    if message is None:  # --test with a data-bin that has a test split: accepted as far as the reference
        message = "--test-ref /x/test: no such file /x/test.en"
    with pytest.raises(SystemExit):
        sweep.main(argv)
    assert message in capsys.readouterr().err
    assert counted == {"fairseq-train": 0, "fairseq-generate": 0} and not (tmp_path / "o").exists()


def test_data_bin_checks(tiny_tr_en, tmp_path, capsys):
    """The pair is the data-bin's (fairseq's file-name order), a missing split or an output inside
    the data-bin is refused."""
    assert sweep.language_pairs(tiny_tr_en["bin"]) == [("tr", "en")]
    assert sweep.resolve_pair(tiny_tr_en["bin"], None, None, ["train", "valid", "test"]) == ("tr", "en")
    assert sweep.resolve_pair(tiny_tr_en["bin"], "en", "tr", ["train", "valid"]) == ("en", "tr")  # one bin, both ways
    partial = tmp_path / "bin"
    partial.mkdir()
    for f in tiny_tr_en["bin"].iterdir():
        if not f.name.startswith("test."):
            (partial / f.name).symlink_to(f)
    with pytest.raises(sweep.SweepError, match=r"no test split for tr-en"):
        sweep.resolve_pair(partial, None, None, ["train", "valid", "test"])
    with pytest.raises(SystemExit):
        sweep.main([str(partial), "--out-dir", str(partial / "sweep"), "--p", "0.2", "--q", "0.2", "--epochs", "2",
                    "--", *TRAIN_ARGS])  # fmt: skip
    assert "lies inside DATA_BIN" in capsys.readouterr().err


def test_diverged_runs_are_recorded_and_the_sweep_still_reports(tiny_tr_en, tmp_path, counted, capsys):
    """At --lr 1e38 every fairseq-train raises FloatingPointError at its first updates: each run is
    recorded as diverged (not translated), the table flags every cell, nothing is ranked, and the
    same command again trains nothing."""
    out = tmp_path / "sweep"
    argv = _argv(tiny_tr_en, out, "--plain", train_args=[*TRAIN_ARGS, "--lr", "1e38"])
    assert sweep.main(argv) == 0
    assert counted == {"fairseq-train": 2, "fairseq-generate": 0}
    table = (out / "results.md").read_text(encoding="utf-8")
    for name in ("plain", "p0.2_q0.3_ga_layers-all_always"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert row.startswith(f"| {name} | 1 | - ± n/a | - |")
        assert row.endswith(
            "| diverged (seed 1: fairseq-train stopped in epoch 1: FloatingPointError: gradients are Nan/Inf) |"
        )
    assert (
        "best on valid: none: no AD-DROP cell can be ranked (each is flagged in the table); plain: diverged, not scored"
        in table
    )
    assert not (out / "heatmap.png").exists()
    assert json.loads((out / "results.json").read_text())["best"] is None
    capsys.readouterr()
    assert sweep.main(argv) == 0
    assert counted == {"fairseq-train": 2, "fairseq-generate": 0}
    assert capsys.readouterr().out.count(": kept from") == 2
