"""The demo and the WMT16 recipe, on local data (no download)."""

import json
import math

import pytest
import sacrebleu

from helpers import REPO, load_script


def test_wmt16_download_writes_parallel_text_in_pair_direction(tmp_path):
    wmt16 = load_script(REPO / "examples" / "wmt16" / "run_wmt16.py", "run_wmt16")
    calls = []

    def fake_load_dataset(name, config):  # stands in for datasets.load_dataset (no network here)
        calls.append((name, config))
        rows = lambda n: {"translation": [{"tr": f"kaynak {i}", "en": f"target {i} "} for i in range(n)]}  # noqa: E731
        return {"train": rows(5), "validation": rows(2), "test": rows(3)}

    counts = wmt16.download("tr-en", tmp_path, load_dataset=fake_load_dataset)
    assert calls == [("wmt16", "tr-en")]
    assert counts == {"train": 5, "valid": 2, "test": 3}
    assert (tmp_path / "test.tr").read_text().splitlines() == ["kaynak 0", "kaynak 1", "kaynak 2"]
    assert (tmp_path / "test.en").read_text().splitlines() == ["target 0", "target 1", "target 2"]


def test_wmt16_rejects_embedded_newlines(tmp_path):
    wmt16 = load_script(REPO / "examples" / "wmt16" / "run_wmt16.py", "run_wmt16")
    bad = {"translation": [{"en": "a\nb", "ro": "c"}]}
    with pytest.raises(ValueError, match="train row 0: embedded newline"):
        wmt16.download("en-ro", tmp_path, load_dataset=lambda *a: {"train": bad, "validation": bad, "test": bad})


def test_pipeline_refuses_mismatched_parallel_files(tmp_path):
    from attn_reg_lab import mt_pipeline as mt

    for split in mt.SPLITS:
        (tmp_path / f"{split}.en").write_text("a\nb\n")
        (tmp_path / f"{split}.ro").write_text("a\nb\n")
    (tmp_path / "valid.ro").write_text("a\n")
    from attn_reg_plugin.prepare import CorpusError

    with pytest.raises(
        CorpusError, match=r"valid\.en has 2 lines but .*valid\.ro has 1: .*valid\.en:2 has no counterpart"
    ):
        mt.prepare_data(tmp_path, tmp_path / "work", "en", "ro", vocab_size=100, log=lambda s: None)
    assert not (tmp_path / "work").exists()  # refused before anything is written


def test_demo_quick_prints_the_table(tmp_path, capsys, forked_runs):
    """The main job's whole pipeline (spm, preprocess, 2x train, generate, sacrebleu, table) at toy size."""
    from attn_reg_lab import demo

    assert demo.main(["--quick", "--epochs", "2", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert (
        "| method | best valid loss | test BLEU | train time (s) | AD-DROP rate | AttendOut drop prob. (last epoch) |"
        in out
    )
    results = json.loads((tmp_path / "demo" / "results.json").read_text())
    rows = results["rows"]
    environment = results["environment"]  # the versions and the lock behind the numbers
    assert environment["packages"]["torch"].startswith("2.") and len(environment["lock_sha256"]) == 16
    assert isinstance(environment["lock_differences"], list)
    assert [r["method"] for r in rows] == ["plain", "AD-DROP", "AttendOut"]
    assert rows[0]["ad_drop_rate"] == "-" and 0 < rows[1]["ad_drop_rate"] < 0.2
    assert rows[1]["attendout_drop_prob"] == "-" and 0 < rows[2]["attendout_drop_prob"] < 1
    assert (tmp_path / "demo" / "attendout_drop_prob.png").stat().st_size > 0  # the Fig. 3 style plot
    assert all(math.isfinite(r["valid_loss"]) and r["valid_loss"] > 0 for r in rows)
    refs = (tmp_path / "demo" / "raw-subset" / "test.ro").read_text(encoding="utf-8").splitlines()
    assert len(refs) == 50  # quick mode keeps 50 test sentences
    for r in rows:  # the table's BLEU is sacrebleu on the written translations of every test sentence
        hyps = (tmp_path / "demo" / "translations" / r["method"] / "test.hyp").read_text(encoding="utf-8").splitlines()
        assert len(hyps) == 50
        assert r["test_bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def test_plot_attendout_reads_the_log_and_rejects_bad_lines(tmp_path):
    from attn_reg_lab import plot_attendout

    log = tmp_path / "drop.jsonl"
    log.write_text(
        '{"update": 20, "drop_prob": {"encoder-self.0": 0.2, "encoder-self.1": 0.3}}\n'
        '{"update": 40, "drop_prob": {"encoder-self.0": 0.25, "encoder-self.1": 0.1}}\n'
    )
    updates, series = plot_attendout.read_log(log)
    assert updates == [20, 40] and series == {"encoder-self.0": [0.2, 0.25], "encoder-self.1": [0.3, 0.1]}
    assert plot_attendout.main([str(log), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    log.write_text('{"update": 20, "drop_prob": {"encoder-self.0": 0.2}}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"drop\.jsonl:2: not an AttendOut drop-probability record"):
        plot_attendout.read_log(log)


def test_lab_commands_name_the_checkout_data_they_miss(tmp_path):
    """Installed from a wheel the shipped data are absent: a command exits naming the option that
    takes its data instead of failing deep inside with FileNotFoundError."""
    from attn_reg_lab import demo

    missing = tmp_path / "no-corpus"
    with pytest.raises(
        SystemExit, match=r"no-corpus not found: it ships with the attn_reg_plugin repository.*pass --data"
    ):
        demo.main(["--data", str(missing), "--out", str(tmp_path / "out"), "--quick"])
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_demo_methods_are_named_in_any_case(tmp_path, capsys):
    """`ad-drop` / `attendout` as the few-shot runner and the benchmark spell them; only the unknown
    name is reported."""
    from attn_reg_lab import demo

    with pytest.raises(SystemExit):
        demo.main(["--methods", "ad-drop,AttendOut,bogus", "--out", str(tmp_path / "out")])
    assert "--methods: unknown ['bogus']" in capsys.readouterr().err


def test_wmt16_train_stage_is_a_valid_plugin_sweep(tmp_path, monkeypatch):
    """The recipe's train stage is attn-reg-mt-sweep with the paper's cell and plain beside it."""
    from attn_reg_plugin import sweep

    wmt16 = load_script(REPO / "examples" / "wmt16" / "run_wmt16.py", "run_wmt16")
    calls = []
    monkeypatch.setattr(sweep, "main", lambda argv: calls.append(argv) or 0)
    assert wmt16.main(["--pair", "tr-en", "--out", str(tmp_path), "--stages", "train"]) == 0
    (argv,) = calls
    split = argv.index("--")
    opts = sweep.build_sweep_parser().parse_args(argv[:split])
    assert (opts.p, opts.q, opts.plain, opts.test) == ("0.6", "0.1", True, True)
    assert (opts.source_lang, opts.target_lang, opts.epochs) == ("tr", "en", 40)
    assert opts.valid_ref == tmp_path / "raw" / "valid"
    train_args = argv[split + 1 :]
    assert not set(train_args) & set(sweep.OWNED), "the recipe passes an option the sweep sets itself"
    assert train_args[train_args.index("--arch") + 1] == "transformer_wmt_en_de"
