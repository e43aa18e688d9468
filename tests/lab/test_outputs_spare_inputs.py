"""No lab command writes to a path it reads (issue 31): an output that is, holds, or lies in an input
is refused by option and path, with exit code 2, before anything is written, read or removed."""

import json

import pytest

from helpers import CORPUS

SPLITS = ("train", "valid", "test")


def _refused(main, argv, capsys, *names):
    """``main(argv)`` exits 2 on its argparse error, naming every option in ``names``; returns the message."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err, err
    message = err.split("error: ", 1)[1]  # not the usage line, which names every option
    for name in names:
        assert name in message, err
    return message


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _corpus_in(folder):
    folder.mkdir(parents=True)
    for split in SPLITS:
        for lang in ("en", "ro"):
            lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:60]
            (folder / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return folder


def test_demo_does_not_clear_an_out_that_holds_its_data(tmp_path, capsys):
    """The demo removes --out before a run: the corpus of an earlier --quick run inside it went with it."""
    from attn_reg_lab import demo

    out = tmp_path / "demo"
    data = _corpus_in(out / "raw-subset")
    before = _snapshot(out)
    err = _refused(demo.main, ["--data", data, "--out", out, "--quick"], capsys, "--out", "--data")
    assert "lies inside it" in err
    assert _snapshot(out) == before


def test_regime_refuses_data_inside_the_folders_it_refills(tmp_path, capsys):
    from attn_reg_lab import regime

    out = tmp_path / "regime"
    data = _corpus_in(out / "data" / "raw")  # where a previous run wrote its subset
    before = _snapshot(out)
    _refused(regime.parse_args, ["--data", data, "--out-dir", out], capsys, "--out-dir", "--data")
    assert _snapshot(out) == before


def test_fig2_refuses_a_training_file_it_would_overwrite(tmp_path, capsys):
    from attn_reg_lab import fig2

    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "dev.jsonl").write_text("{}")
    argv = ["--train", tmp_path / "results.json", "--dev", tmp_path / "dev.jsonl", "--out-dir", tmp_path]
    _refused(fig2.parse_args, argv, capsys, "--out-dir", "--train", "results.json")


def test_fewshot_refuses_a_data_file_named_like_its_results(tmp_path, capsys):
    from attn_reg_lab import fewshot

    for name in ("runs.jsonl", "dev.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("{}\n")
    argv = ["--train", tmp_path / "runs.jsonl", "--dev", tmp_path / "dev.jsonl", "--test", tmp_path / "test.jsonl"]
    _refused(fewshot.parse_args, [*argv, "--out-dir", tmp_path, "--model", "unused"], capsys, "--out-dir", "--train")


def test_fewshot_merge_does_not_write_its_table_over_a_results_file(tmp_path, capsys):
    from attn_reg_lab.fewshot_merge import main as merge_main

    config = {"model": "m", "num_labels": 2, "max_length": 64, "dev_subset": None, "training": {"lr": 1e-4}}
    run = dict(size=16, seed=1, method="plain", test_acc=0.5, best_dev_acc=0.5, best_epoch=1, epochs=[])
    base = tmp_path / "results.json"
    base.write_text(json.dumps({"config": config, "runs": [run]}))
    before = base.read_bytes()
    _refused(merge_main, ["--baseline", base, "--out", base], capsys, "--out", "--baseline")
    assert base.read_bytes() == before


@pytest.mark.parametrize("explicit_out", [True, False])
def test_plot_attendout_does_not_draw_over_its_log(tmp_path, capsys, explicit_out):
    from attn_reg_lab import plot_attendout

    log = tmp_path / ("drop.jsonl" if explicit_out else "drop.png")  # drop.png's default PNG is itself
    log.write_text(json.dumps({"epoch": 1, "num_updates": 1, "layers": {"encoder.0": 0.1}}) + "\n")
    before = log.read_bytes()
    argv = [log, "--out", log] if explicit_out else [log]
    _refused(plot_attendout.main, argv, capsys, "--out", "LOG")
    assert log.read_bytes() == before


def test_attribution_agreement_refuses_an_out_over_its_checkpoint(tmp_path, capsys):
    from attn_reg_lab import attribution_agreement

    checkpoint, data_bin = tmp_path / "checkpoint_best.pt", tmp_path / "data-bin"
    checkpoint.write_bytes(b"weights")
    data_bin.mkdir()
    argv = ["--fairseq-checkpoint", checkpoint, "--data-bin", data_bin]
    _refused(attribution_agreement.parse_args, [*argv, "--out", checkpoint], capsys, "--out", "--fairseq-checkpoint")
    _refused(attribution_agreement.parse_args, [*argv, "--out", data_bin / "dict.en.txt"], capsys, "--data-bin")


def test_attribution_picture_refuses_an_out_whose_json_is_in_the_model(tmp_path, capsys):
    from attn_reg_lab import attribution_picture

    model = tmp_path / "model"
    model.mkdir()
    argv = ["--hf-model", model, "--sentence", "a film", "--out", model / "config"]  # writes config.png, config.json
    _refused(attribution_picture.parse_args, argv, capsys, "--out", "--hf-model")


def test_benchmark_does_not_write_its_rows_into_the_corpus_it_reads(tmp_path, capsys):
    pytest.importorskip("fairseq")
    from attn_reg_lab.benchmark import cli
    from attn_reg_lab.benchmark.fairseq_bench import corpus_dir

    data_bin = corpus_dir(tmp_path, quick=True) / "data-bin"
    argv = ["--quick", "--work-dir", tmp_path, "--variants", "attendout", "--out", data_bin / "dict.en.txt"]
    _refused(cli.parse_args, argv, capsys, "--out", "--work-dir")
    cli.parse_args(
        ["--quick", "--work-dir", str(tmp_path), "--variants", "attendout", "--out", str(tmp_path / "rows.json")]
    )
