"""Reading a classifier's data files (``prepare_classification.read_examples``, shared by attn-reg-cls-compare
and attn-reg-prepare-cls): GLUE's unquoted TSV, Excel's UTF-8 CSV, JSON arrays, and errors that name the
file's line, its byte offset and the flag that fixes a wrong field name."""

import json

import pytest

from attn_reg_plugin.prepare import PrepareError
from attn_reg_plugin.prepare_classification import read_examples


def _glue_tsv(path, rows):
    path.write_text("sentence\tlabel\n" + "".join(f"{text}\t{label}\n" for text, label in rows), encoding="utf-8")


def test_a_glue_tsv_text_that_opens_with_a_quote_keeps_every_row(tmp_path):
    """GLUE's TSVs have no quoting: csv's default reader swallowed the lines after a text opening with
    '"' into it (104 lines read as 93 examples)."""
    rows = [(f"review {i} is fine", i % 2) for i in range(103)]
    rows[10] = ('"Dead Poets" meets the classroom, sort of', 1)
    rows[40] = ('he said "no', 0)  # an unclosed quote inside a text
    path = tmp_path / "train.tsv"
    _glue_tsv(path, rows)
    got = read_examples(path, ["sentence"], "label")
    assert len(got) == 103
    assert got[10] == {"sentence": '"Dead Poets" meets the classroom, sort of', "label": "1"}
    assert got[40] == {"sentence": 'he said "no', "label": "0"}
    assert [e["label"] for e in got] == [str(label) for _, label in rows]


def test_a_tsv_row_with_a_field_too_many_or_few_is_named(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("sentence\tlabel\nfine\t1\ntab\tinside\t0\n", encoding="utf-8")
    with pytest.raises(PrepareError, match=r"dev.tsv:3: 3 fields, the header names 2 \(sentence, label\)"):
        read_examples(path, ["sentence"], "label")


def test_a_quoted_csv_keeps_its_quoting(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('sentence,label\n"a, quoted ""text""",1\nplain,0\n', encoding="utf-8")
    assert read_examples(path, ["sentence"], "label") == [
        {"sentence": 'a, quoted "text"', "label": "1"},
        {"sentence": "plain", "label": "0"},
    ]


def test_excels_utf8_csv_with_a_byte_order_mark_is_read(tmp_path):
    """Excel's "CSV UTF-8" starts with a BOM: read as utf-8 it became part of the first header field."""
    path = tmp_path / "train.csv"
    path.write_bytes("sentence,label\nnaïve but fun,1\n".encode("utf-8-sig"))
    assert read_examples(path, ["sentence"], "label") == [{"sentence": "naïve but fun", "label": "1"}]


def test_a_bad_byte_is_named_by_its_offset_in_the_file_and_its_line(tmp_path):
    """It was reported at the offset inside the decoder's chunk (byte 2347 for a byte at 43,307)."""
    lines = [
        f'{{"sentence": "review number {i:05d} of many, long enough to fill chunks", "label": 1}}\n'
        for i in range(1500)
    ]
    head = "".join(lines[:1200]).encode("utf-8")
    data = head + b'{"sentence": "bad \xff byte", "label": 0}\n' + "".join(lines[1200:]).encode("utf-8")
    path = tmp_path / "train.jsonl"
    path.write_bytes(data)
    offset = len(head) + len('{"sentence": "bad ')
    assert offset > 65536  # past any one read of the file
    with pytest.raises(
        PrepareError, match=rf"train.jsonl:1201: not UTF-8 \(.* at byte {offset} of the file, line 1201\)"
    ):
        read_examples(path, ["sentence"], "label")


@pytest.mark.parametrize(
    "suffix, text",
    [
        (".jsonl", '{"text": "fine", "label": 1}\n'),
        (".csv", "text,label\nfine,1\n"),
        (".tsv", "text\tlabel\nfine\t1\n"),
    ],
)
def test_a_field_the_rows_lack_names_their_fields_and_the_flag(tmp_path, suffix, text):
    path = tmp_path / f"train{suffix}"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PrepareError) as e:
        read_examples(path, ["sentence"], "label")
    assert str(e.value).endswith(
        f"train{suffix}:{1 if suffix == '.jsonl' else 2}: no field 'sentence'; the row's fields are 'text', 'label' "
        "(name the right one with --text-field)"
    )
    with pytest.raises(PrepareError, match=r"no field 'gold'; .* \(name the right one with --label-field\)"):
        read_examples(path, ["text"], "gold")
    with pytest.raises(PrepareError, match=r"no field 'hypothesis'; .* \(name the right one with --pair-field\)"):
        read_examples(path, ["text", "hypothesis"], "label")


def test_a_json_array_file_is_read_and_its_bad_item_named(tmp_path):
    path = tmp_path / "train.json"
    rows = [{"sentence": "good", "label": "pos"}, {"sentence": "bad", "label": "neg"}]
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    assert read_examples(path, ["sentence"], "label") == rows
    path.write_text(json.dumps([*rows, {"sentence": "", "label": "pos"}]), encoding="utf-8")
    with pytest.raises(PrepareError, match=r"train.json:item 3: field 'sentence' must be a non-empty string"):
        read_examples(path, ["sentence"], "label")
    lines = tmp_path / "lines.json"  # JSON lines under .json, as before
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert read_examples(lines, ["sentence"], "label") == rows


def test_a_line_separator_inside_a_text_does_not_split_its_row(tmp_path):
    """str.splitlines splits at U+2028; a JSON line or a TSV row holding one raw is still one row."""
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\none\u2028two\t1\n", encoding="utf-8")
    assert read_examples(path, ["sentence"], "label") == [{"sentence": "one two", "label": "1"}]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"sentence": "one\u2028two", "label": 1}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_examples(path, ["sentence"], "label") == [{"sentence": "one two", "label": "1"}]
