"""examples/conll: the script's own code path on a hand-written NER file with the real MiniLM encoder."""

import json
import math

import pytest

from helpers import REPO, TEST_DATA, load_script, minilm_path

NER = TEST_DATA / "conll_tiny.jsonl"


conll = load_script(REPO / "examples" / "conll" / "run_conll.py", "run_conll")


def test_local_ner_plain_then_ad_drop_epoch(tmp_path, capsys):
    p, q = 0.3, 0.3
    out = tmp_path / "out"
    assert (
        conll.main(
            [
                "--model",
                minilm_path(),
                "--train-file",
                str(NER),
                "--validation-file",
                str(NER),
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--lr",
                "1e-4",
                "--methods",
                "ad-drop",
                "--ad-drop-p",
                str(p),
                "--ad-drop-q",
                str(q),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    (result,) = json.loads((out / "results.json").read_text())
    first, second = result["epochs"]
    assert first["ad_drop_on"] == 0 and first["ad_drop_rate"] == 0
    assert second["ad_drop_on"] == 1 and 0.5 * p * q < second["ad_drop_rate"] < p * q + 0.05, second
    for e in result["epochs"]:
        assert math.isfinite(e["train_loss"]) and 0 <= e["eval_f1"] <= 1 and 0 <= e["eval_token_accuracy"] <= 1
    assert "| AD-DROP | " in printed and "dev f1" in printed


def test_first_word_piece_carries_the_tag():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(minilm_path())
    sentences = [(["Kipchoge", "won", "."], [conll.CONLL_LABELS.index("B-PER"), 0, 0])]
    (feature,) = conll.align_labels(tok, sentences, 64, "test")
    pieces = tok.convert_ids_to_tokens(feature["input_ids"])
    n_name = len(tok.tokenize("Kipchoge"))
    assert n_name > 1  # the name is split, so the test means something
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"
    assert feature["labels"] == [-100, 1] + [-100] * (n_name - 1) + [0, 0, -100]
    with pytest.raises(ValueError, match=r"test sentence 0: \d+ word pieces exceed --max-length 4"):
        conll.align_labels(tok, sentences, 4, "test")


def test_entity_spans_and_f1_on_hand_built_tags():
    assert conll.entity_spans(["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-ORG"]) == {
        (0, 2, "PER"),
        (3, 4, "LOC"),
        (4, 5, "LOC"),
        (5, 6, "ORG"),
    }
    assert conll.entity_spans(["I-MISC", "I-MISC", "I-PER"]) == {(0, 2, "MISC"), (2, 3, "PER")}  # IOB1 starts
    gold = [["B-PER", "I-PER", "O", "B-LOC"]]
    pred = [["B-PER", "O", "O", "B-LOC"]]  # PER span cut short: wrong; LOC right
    assert conll.entity_f1(pred, gold) == {"precision": 0.5, "recall": 0.5, "f1": 0.5}
    assert conll.entity_f1([["O"]], [["O"]])["f1"] == 0.0


@pytest.mark.parametrize(
    "line,message",
    [
        (
            '{"tokens": ["Paris"], "ner_tags": ["B-CITY"]}',
            r":2: tag 0 \('B-CITY', token 'Paris'\) is not in the label set",
        ),
        ('{"tokens": [], "ner_tags": []}', r":2: empty sentence"),
        ('{"tokens": ["a", "b"], "ner_tags": ["O"]}', r":2: 2 tokens but 1 ner_tags"),
        ('{"tokens": ["a", ""], "ner_tags": ["O", "O"]}', r":2: token 1 is empty"),
        ('{"tokens": ["a"], "ner_tags": ["O"]', r":2: not valid JSON"),
        ('{"tokens": "a b", "ner_tags": ["O", "O"]}', r":2: needs lists 'tokens' and 'ner_tags'"),
    ],
)
def test_local_file_rejects_malformed_lines(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": ["Rome"], "ner_tags": ["B-LOC"]}\n' + line + "\n", encoding="utf-8")
    args = conll.parse_args(["--out", str(tmp_path), "--train-file", str(bad), "--validation-file", str(NER)])
    with pytest.raises(ValueError, match=r"bad\.jsonl" + message):
        conll.load_split(args, "train")


def test_local_file_rejects_non_utf8(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"tokens": ["Rome"], "ner_tags": ["B-LOC"]}\n{"tokens": ["K\xf6ln"], "ner_tags": ["B-LOC"]}\n')
    args = conll.parse_args(["--out", str(tmp_path), "--train-file", str(bad), "--validation-file", str(NER)])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid UTF-8"):
        conll.load_split(args, "train")


def test_hub_rows_use_the_dataset_label_names(tmp_path):
    class Names:
        names = list(conll.CONLL_LABELS)

    class Split(list):
        features = {"ner_tags": type("Seq", (), {"feature": Names})}

    split = Split([{"tokens": ["Rome"], "ner_tags": [5]}, {"tokens": ["x"], "ner_tags": [9]}])
    args = conll.parse_args(["--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"conll2003 validation row 1: tag 0 \(9, token 'x'\) is not in the label set"):
        conll.load_split(args, "dev", load_dataset=lambda name: {"validation": split})
    ok = Split(split[:1])
    rows, labels = conll.load_split(args, "train", load_dataset=lambda name: {"train": ok})
    assert rows == [(["Rome"], [5])] and labels[5] == "B-LOC"
