"""attn-reg-regime on 120 pairs for 2 epochs: runs, BLEU of the best checkpoint, paired table, resume."""

import json

import pytest
import sacrebleu

from attn_reg_lab import regime

pytest.importorskip("fairseq")


@pytest.mark.slow  # 4 fairseq trainings and translations, about a minute: make test-all
def test_two_methods_two_seeds_then_a_resume_that_trains_nothing(tmp_path, capsys):
    out = tmp_path / "regime"
    argv = ["--train-size", "120", "--epochs", "2", "--seeds", "1,2", "--methods", "plain,rd", "--vocab-size",
            "300", "--test-size", "8", "--out-dir", str(out)]  # fmt: skip
    assert regime.main(argv) == 0
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {(r["method"], r["seed"]): r for r in result["runs"]}
    assert set(runs) == {("plain", 1), ("rd", 1), ("plain", 2), ("rd", 2)}
    for run in runs.values():
        valid = [e["valid_loss"] for e in run["epochs"]]
        assert run["best_valid_loss"] == min(valid) and valid[run["best_epoch"] - 1] == min(valid)
        assert run["final_gap"] == pytest.approx(
            run["epochs"][-1]["valid_loss"] - run["epochs"][-1]["train_loss"], abs=1e-4
        )
        # The reported BLEU is sacrebleu's over the hypotheses written beside it, against the 8 references.
        hyps = (out / "translations" / f"{run['method']}-seed{run['seed']}" / "test.hyp").read_text().split("\n")[:-1]
        refs = (out / "data" / "raw" / "test.ro").read_text().split("\n")[:-1]
        assert len(hyps) == len(refs) == 8
        assert run["test_bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert all(e["ad_drop_rate"] > 0 for e in runs[("rd", 1)]["epochs"])  # always on, epoch 1 too
    assert all(e["ad_drop_rate"] == 0 for e in runs[("plain", 1)]["epochs"])
    (paired,) = [p for p in result["summary"]["paired"] if p["measure"] == "test_bleu"]
    diffs = [runs[("rd", s)]["test_bleu"] - runs[("plain", s)]["test_bleu"] for s in (1, 2)]
    assert paired["pairs"] == 2 and paired["mean_diff"] == pytest.approx(sum(diffs) / 2)
    assert (out / "curves.png").exists() and "| rd | test_bleu | 2 |" in (out / "results.md").read_text()
    capsys.readouterr()
    assert regime.main(argv) == 0
    assert "== plain, seed 1:" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        regime.main([*argv[:-2], "--epochs", "3", "--out-dir", str(out)])


def test_summary_pairs_each_method_with_plain_at_the_same_seed():
    def run(method, seed, valid, bleu):
        epochs = [
            {"epoch": i + 1, "train_loss": 1.0, "valid_loss": v, "ad_drop_rate": 0.0} for i, v in enumerate(valid)
        ]
        best = min(range(len(valid)), key=lambda i: valid[i])
        return {"method": method, "seed": seed, "best_valid_loss": valid[best], "best_epoch": best + 1,
                "test_bleu": bleu, "final_gap": valid[-1] - 1.0, "train_seconds": 10.0, "epochs": epochs}  # fmt: skip

    runs = [run("plain", 1, [5.0, 4.0, 4.5], 10.0), run("plain", 2, [5.0, 3.0, 3.9], 12.0),
            run("rd", 1, [5.0, 4.2, 4.3], 11.0), run("rd", 2, [5.0, 3.1, 3.5], 12.5), run("rd", 3, [4.0, 2.0, 2.0], 1.0)]  # fmt: skip
    summary = regime.summarize(runs, ["plain", "rd"])
    rows = {r["method"]: r for r in summary["table"]}
    assert rows["plain"]["final_valid_loss"] == pytest.approx(4.2) and rows["rd"]["seeds"] == 3
    assert rows["plain"]["best_epoch"] == 2 and rows["plain"]["best_epoch_std"] == 0
    paired = {p["measure"]: p for p in summary["paired"]}
    assert set(paired) == {"best_valid_loss", "test_bleu", "final_valid_loss"}
    # Seed 3 has no plain run, so it is in rd's row but in no pair.
    assert paired["final_valid_loss"]["pairs"] == 2
    assert paired["final_valid_loss"]["mean_diff"] == pytest.approx(((4.3 - 4.5) + (3.5 - 3.9)) / 2)
    assert paired["test_bleu"]["mean_diff"] == pytest.approx(0.75)
    assert paired["best_valid_loss"]["mean_diff"] == pytest.approx(0.15)
    assert "| rd | 3 |" in regime.markdown(summary) and "last valid loss" in regime.markdown(summary)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--methods", "plain,dropout"], "--methods: unknown 'dropout'"),
        (["--methods", "plain,plain"], "--methods: repeated value in 'plain,plain'"),
        (["--epochs", "1"], "--epochs must be >= 2"),
        (["--fp16"], "--fp16 needs --device cuda"),
    ],
)
def test_bad_options_fail_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit):
        regime.parse_args(argv)
    assert message in capsys.readouterr().err


def test_curves_band_over_seeds_and_the_late_panel_of_long_runs(tmp_path):
    from attn_reg_lab.curves import band, zoom_start

    runs = [{"epochs": [{"valid_loss": v} for v in vs]} for vs in ([3.0, 2.0, 2.5], [5.0, 1.0, 2.5], [4.0, 3.0, 1.0])]
    assert band(runs, "valid_loss", 2) == {"mean": [4.0, 2.0], "low": [3.0, 1.0], "high": [5.0, 3.0]}
    assert (zoom_start(29), zoom_start(30), zoom_start(60)) == (None, 11, 21)
    for epochs in (3, 30):  # without and with the zoomed third panel
        curve = [{"epoch": e + 1, "train_loss": 9.0 - e / 10, "valid_loss": 8.0 - e / 20} for e in range(epochs)]
        plain = {"method": "plain", "seed": 1, "epochs": curve}
        regime.plot([plain, {**plain, "seed": 2}, {**plain, "method": "rd"}], ["plain", "rd"], tmp_path / "c.png", "t")
        assert (tmp_path / "c.png").stat().st_size > 0
