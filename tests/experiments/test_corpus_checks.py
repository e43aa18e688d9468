"""The MT pipeline's corpus check: malformed parallel text is refused with its file and line."""
import pytest

from attn_reg_plugin.experiments import mt_pipeline as mt
from helpers import CORPUS

GOOD = "first sentence\nsecond one\nthird\n"


def _corpus(tmp_path, **overrides):
    """{split}.{en,ro} files holding GOOD, with some replaced by raw bytes."""
    for split in mt.SPLITS:
        for lang in ("en", "ro"):
            (tmp_path / f"{split}.{lang}").write_bytes(overrides.get(f"{split}_{lang}", GOOD.encode()))
    return tmp_path


def test_shipped_corpus_passes_and_counts_every_line():
    counts = mt.check_parallel(CORPUS, "en", "ro")
    for split, n in counts.items():
        assert n == len((CORPUS / f"{split}.en").read_bytes().split(b"\n")) - 1  # every line, none skipped


def test_counts_crlf_and_missing_final_newline_like_text_mode(tmp_path):
    _corpus(tmp_path, train_en=b"a b\r\nc d\r\ne", train_ro=b"x\ny\nz")
    assert mt.check_parallel(tmp_path, "en", "ro") == {"train": 3, "valid": 3, "test": 3}


@pytest.mark.parametrize("name, content, message", [
    ("train_ro", b"one\ntwo\n", r"train\.en has 3 lines but \S*train\.ro has 2: \S*train\.en:3 has no counterpart"),
    ("test_en", GOOD.encode() + b"fourth\n", r"test\.en has 4 lines but \S*test\.ro has 3: \S*test\.en:4 has no counterpart"),
    ("valid_ro", b"first\n\nthird\n", r"valid\.ro:2: empty line"),
    ("valid_en", b"first\n  \t \nthird\n", r"valid\.en:2: empty line"),
    ("train_en", b"a\nb\nc\n\n", r"train\.en:4: empty line"),  # a trailing blank line is a 4th, empty, sentence
    ("train_ro", "unu\ndoi\ntrei ".encode() + b"\xff\xfe\n", r"train\.ro:3: not valid UTF-8 \(byte 0xff at byte 6 of the line\)"),
    ("test_ro", "ş\n".encode("cp1250") + b"b\nc\n", r"test\.ro:1: not valid UTF-8 \(byte 0xba at byte 1"),
    ("valid_en", b"half\rline\nb\nc\n", r"valid\.en:1: carriage return inside the line"),
    ("test_en", b"", r"test\.en: the file is empty"),
])
def test_malformed_input_is_refused_with_file_and_line(tmp_path, name, content, message):
    _corpus(tmp_path, **{name: content})
    with pytest.raises(mt.CorpusError, match=message):
        mt.check_parallel(tmp_path, "en", "ro")


def test_missing_file_is_named(tmp_path):
    _corpus(tmp_path)
    (tmp_path / "valid.ro").unlink()
    with pytest.raises(FileNotFoundError, match=r"valid\.ro"):
        mt.check_parallel(tmp_path, "en", "ro")


def test_prepare_data_stops_before_any_work_on_bad_input(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _corpus(raw, valid_ro=b"a\n\nc\n")
    with pytest.raises(mt.CorpusError, match=r"valid\.ro:2: empty line"):
        mt.prepare_data(raw, tmp_path / "work", "en", "ro", vocab_size=50, log=lambda s: None)
    assert not (tmp_path / "work").exists()  # no sentencepiece model, no data-bin
