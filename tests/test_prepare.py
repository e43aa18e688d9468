"""attn-reg-prepare: malformed parallel text is refused with its file and line before anything is
written; good text of any language pair becomes a data-bin that fairseq-train reads."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attn_reg_plugin import prepare as prep
from attn_reg_plugin.paths import OutputOverwritesInputError, check_outputs_spare_inputs
from helpers import CORPUS, VENV_BIN

SPLITS = ("train", "valid", "test")

GOOD = "first sentence\nsecond one\nthird\n"


def _corpus(tmp_path, **overrides):
    """{split}.{en,ro} files holding GOOD, with some replaced by raw bytes."""
    for split in SPLITS:
        for lang in ("en", "ro"):
            (tmp_path / f"{split}.{lang}").write_bytes(overrides.get(f"{split}_{lang}", GOOD.encode()))
    return tmp_path


def test_shipped_corpus_passes_and_counts_every_line():
    counts = prep.check_parallel({s: CORPUS / s for s in SPLITS}, "en", "ro")
    for split, n in counts.items():
        assert n == len((CORPUS / f"{split}.en").read_bytes().split(b"\n")) - 1  # every line, none skipped


def test_counts_crlf_and_missing_final_newline_like_text_mode(tmp_path):
    _corpus(tmp_path, train_en=b"a b\r\nc d\r\ne", train_ro=b"x\ny\nz")
    assert prep.check_parallel({s: tmp_path / s for s in SPLITS}, "en", "ro") == {"train": 3, "valid": 3, "test": 3}


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("train_ro", b"one\ntwo\n", r"train\.en has 3 lines but \S*train\.ro has 2: \S*train\.en:3 has no counterpart"),
        (
            "test_en",
            GOOD.encode() + b"fourth\n",
            r"test\.en has 4 lines but \S*test\.ro has 3: \S*test\.en:4 has no counterpart",
        ),
        ("valid_ro", b"first\n\nthird\n", r"valid\.ro:2: empty line"),
        ("valid_en", b"first\n  \t \nthird\n", r"valid\.en:2: empty line"),
        ("train_en", b"a\nb\nc\n\n", r"train\.en:4: empty line"),  # a trailing blank line is a 4th, empty, sentence
        (
            "train_ro",
            b"unu\ndoi\ntrei " + b"\xff\xfe\n",
            r"train\.ro:3: not valid UTF-8 \(byte 0xff at byte 6 of the line\)",
        ),
        ("test_ro", "ş\n".encode("cp1250") + b"b\nc\n", r"test\.ro:1: not valid UTF-8 \(byte 0xba at byte 1"),
        ("valid_en", b"half\rline\nb\nc\n", r"valid\.en:1: carriage return inside the line"),
        ("test_en", b"", r"test\.en: the file is empty"),
    ],
)
def test_malformed_input_is_refused_with_file_and_line(tmp_path, name, content, message):
    _corpus(tmp_path, **{name: content})
    with pytest.raises(prep.CorpusError, match=message):
        prep.check_parallel({s: tmp_path / s for s in SPLITS}, "en", "ro")


def test_missing_file_is_named(tmp_path):
    _corpus(tmp_path)
    (tmp_path / "valid.ro").unlink()
    with pytest.raises(prep.CorpusError, match=r"valid\.ro: no such file"):
        prep.check_parallel({s: tmp_path / s for s in SPLITS}, "en", "ro")


def test_prepare_data_stops_before_any_work_on_bad_input(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _corpus(raw, valid_ro=b"a\n\nc\n")
    with pytest.raises(prep.CorpusError, match=r"valid\.ro:2: empty line"):
        prep.prepare("en", "ro", {s: raw / s for s in SPLITS}, tmp_path / "work", vocab_size=50, log=lambda s: None)
    assert not (tmp_path / "work").exists()  # no sentencepiece model, no data-bin


def _pair(folder, split, src_lines, tgt_lines, src="en", tgt="tr"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.{src}").write_text("".join(src_lines), encoding="utf-8")
    (folder / f"{split}.{tgt}").write_text("".join(tgt_lines), encoding="utf-8")
    return folder / split


def _cut(split, n):
    return [
        (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:n] for lang in ("en", "ro")
    ]


def _prepare_cli(args):
    """The installed console script, in a process of its own (what a user runs)."""
    return subprocess.run(
        [str(VENV_BIN / "attn-reg-prepare"), *map(str, args)],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )


def _prepare_main(args, capsys):
    """The command's ``main`` in this process (no interpreter start-up per refusal): (exit code, output)."""
    try:
        code = prep.main([str(a) for a in args])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_prepare_command_binarizes_any_language_pair_from_prefixes_in_different_folders(tmp_path):
    """An unseen pair (the target side stored as .tr), each split in its own folder."""
    train = _pair(tmp_path / "raw" / "train-dir", "corpus", *_cut("train", 300))
    valid = _pair(tmp_path / "raw" / "dev", "newsdev", *_cut("valid", 20))
    proc = _prepare_cli(
        [
            "--src",
            "en",
            "--tgt",
            "tr",
            "--train",
            train,
            "--valid",
            valid,
            "--vocab-size",
            "300",
            "--out",
            tmp_path / "work",
        ]
    )
    assert proc.returncode == 0, proc.stdout
    assert "train 300 pairs" in proc.stdout and "valid 20 pairs" in proc.stdout
    data_bin = tmp_path / "work" / "data-bin"
    assert (data_bin / "dict.en.txt").read_text() == (data_bin / "dict.tr.txt").read_text()  # one joined dictionary
    for split in ("train", "valid"):
        for lang in ("en", "tr"):
            assert (data_bin / f"{split}.en-tr.{lang}.bin").stat().st_size > 0
    assert not list(data_bin.glob("test.*"))  # --test is optional
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "work" / "spm" / "spm.model"))
    assert sp.get_piece_size() == 300
    from fairseq.data import data_utils

    train_src = data_utils.load_indexed_dataset(str(data_bin / "train.en-tr.en"), None)
    assert len(train_src) == 300
    # The one joint data-bin trains either direction (docs/FAIRSEQ.md): -s tr -t en reads train.en-tr.*
    # with the sides swapped.
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    for src, tgt in (("en", "tr"), ("tr", "en")):
        parser = options.get_training_parser()
        args = ["--task", "translation", "-s", src, "-t", tgt, "--arch", "transformer", str(data_bin)]
        task = tasks.setup_task(convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, args)).task)
        task.load_dataset("train")
        pair, side = task.dataset("train"), data_utils.load_indexed_dataset(str(data_bin / f"train.en-tr.{src}"), None)
        assert len(pair) == 300 and pair[7]["source"].tolist() == side[7].tolist()


@pytest.mark.parametrize(
    "broken, message",
    [
        ("mismatch", r"valid\.tr has 2 lines but \S*valid\.en has 3|valid\.en has 3 lines but \S*valid\.tr has 2"),
        ("empty", r"valid\.tr: the file is empty"),
        ("latin1", r"valid\.tr:2: not valid UTF-8"),
        ("missing", r"valid\.tr: no such file"),
    ],
)
def test_prepare_command_refuses_bad_corpora_before_writing_anything(tmp_path, broken, message, capsys):
    train = _pair(tmp_path / "raw", "train", *_cut("train", 50))
    tgt = {"mismatch": "a\nb\n", "empty": "", "latin1": None, "missing": None}[broken]
    valid = _pair(tmp_path / "raw", "valid", ["x\n", "y\n", "z\n"], [tgt or ""])
    if broken == "latin1":
        (tmp_path / "raw" / "valid.tr").write_bytes("bir\nçok\nüç\n".encode("latin-1"))
    if broken == "missing":
        (tmp_path / "raw" / "valid.tr").unlink()
    code, output = _prepare_main(
        ["--src", "en", "--tgt", "tr", "--train", train, "--valid", valid, "--out", tmp_path / "work"], capsys
    )
    assert code == 2, output
    assert re.search(message, output), output
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--src", "en", "--tgt", "en"], "--src and --tgt are both 'en'"),
        (["--src", "e n", "--tgt", "tr"], "--src 'e n': a language suffix"),
        (["--src", "en", "--tgt", "tr", "--vocab-size", "10"], "--vocab-size 10: must be at least 100"),
        (["--src", "en", "--tgt", "tr", "--workers", "0"], "--workers 0: must be at least 1"),
    ],
)
def test_prepare_command_refuses_bad_options_by_name(tmp_path, args, message, capsys):
    code, output = _prepare_main(
        [*args, "--train", tmp_path / "train", "--valid", tmp_path / "valid", "--out", tmp_path / "work"], capsys
    )
    assert code == 2 and message in output, output
    assert not (tmp_path / "work").exists()


def test_prepare_command_refuses_an_existing_data_bin(tmp_path, capsys):
    (tmp_path / "work" / "data-bin").mkdir(parents=True)
    code, output = _prepare_main(
        [
            "--src",
            "en",
            "--tgt",
            "tr",
            "--train",
            tmp_path / "t",
            "--valid",
            tmp_path / "v",
            "--out",
            tmp_path / "work",
        ],
        capsys,
    )
    assert code == 2 and "already exists" in output, output


def test_prepare_command_names_the_vocabulary_option_sentencepiece_cannot_meet(tmp_path):
    """The default 8,000 pieces from 50 pairs: sentencepiece's limit, by option, exit 2, no model left."""
    train = _pair(tmp_path / "raw", "train", *_cut("train", 50))
    valid = _pair(tmp_path / "raw", "valid", *_cut("valid", 5))
    proc = _prepare_cli(["--src", "en", "--tgt", "tr", "--train", train, "--valid", valid, "--out", tmp_path / "work"])
    assert proc.returncode == 2, proc.stdout
    assert re.search(r"--vocab-size 8000 / --character-coverage 1.0: sentencepiece cannot build .*<= \d+", proc.stdout)
    assert "Traceback" not in proc.stdout
    assert not (tmp_path / "work" / "spm").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--src", "en-US", "--tgt", "tr"], "write en_US, not en-US"),
        (["--src", "en", "--tgt", "tr", "--character-coverage", "0"], "--character-coverage 0.0: must be in (0, 1]"),
    ],
)
def test_prepare_command_refuses_suffixes_fairseq_would_misread(tmp_path, args, message, capsys):
    code, output = _prepare_main(
        [*args, "--train", tmp_path / "t", "--valid", tmp_path / "v", "--out", tmp_path / "work"], capsys
    )
    assert code == 2 and message in output, output


def test_prepare_command_refuses_a_comma_in_a_path(tmp_path, capsys):
    train = _pair(tmp_path / "raw", "train", *_cut("train", 50))
    valid = _pair(tmp_path / "raw", "valid", *_cut("valid", 5))
    code, output = _prepare_main(
        ["--src", "en", "--tgt", "tr", "--train", train, "--valid", valid, "--out", tmp_path / "a,b"], capsys
    )
    assert code == 2 and "--out" in output and "comma" in output, output
    assert not (tmp_path / "a,b").exists()


# -- lines that sentencepiece normalises to nothing ------------------------------------------------


@pytest.mark.parametrize(
    "content, held",
    [
        ("first\n\u200b\nthird\n", "U+200B"),  # a zero-width space alone
        ("first\n\ufeff\nthird\n", "U+FEFF"),  # a BOM on a line of its own
        ("first\n\x01\x02\nthird\n", "U+0001, U+0002"),  # C0 controls
        ("first\n \u00a0\u3000\u200b\nthird\n", "U+200B"),  # no-break and ideographic spaces are spaces
    ],
)
def test_a_line_that_normalises_to_nothing_is_an_empty_line(tmp_path, content, held):
    """str.strip() keeps these characters, sentencepiece's nmt_nfkc removes them: an empty sentence."""
    _corpus(tmp_path, valid_ro=content.encode())
    with pytest.raises(
        prep.CorpusError, match=rf"valid\.ro:2: empty line after normalisation \(it holds only {re.escape(held)}\)"
    ):
        prep.check_parallel({s: tmp_path / s for s in SPLITS}, "en", "ro")


def test_a_bom_at_the_start_of_the_file_before_text_is_accepted(tmp_path):
    _corpus(tmp_path, train_en="\ufeffHello\nsecond\u200b one\nthird\n".encode())
    assert prep.check_parallel({s: tmp_path / s for s in SPLITS}, "en", "ro")["train"] == 3


def test_the_emptiness_rule_is_sentencepieces_normaliser(prepared):
    """Lines check_text_file calls empty are exactly those a trained model encodes to no piece."""
    import sentencepiece as spm

    model = spm.SentencePieceProcessor(model_file=str(prepared / "spm" / "spm.model"))
    for text in ["\u200b", "\ufeff", "\x01\x02", "\x7f", "\u2028", "\u2581", " \t", "\ufeffHello", "a", "\u00ad"]:
        assert prep._has_pieces(text) == bool(model.encode(text)), repr(text)
        assert prep._nmt_nfkc_leaves_text(text) == bool(model.encode(text)), repr(text)


def test_the_fallback_rule_matches_sentencepieces_normaliser_on_every_code_point():
    """Without SentencePieceNormalizer (sentencepiece < 0.2.0) the rule is written out; same answers."""
    real = prep._normaliser()
    if real is None:
        pytest.skip("this sentencepiece has no SentencePieceNormalizer")
    differ = [
        f"U+{cp:04X}"
        for cp in range(1, 0x110000)
        if not 0xD800 <= cp < 0xE000 and prep._nmt_nfkc_leaves_text(chr(cp)) != (real.normalize(chr(cp)) != "")
    ]
    assert differ == []


# -- an output that is an input ---------------------------------------------------------------------


def test_same_path_is_refused_naming_options_and_paths(tmp_path):
    (tmp_path / "a.en").write_text("x\n")
    with pytest.raises(OutputOverwritesInputError) as e:
        check_outputs_spare_inputs([("--out", tmp_path / "a.en")], [("--train", tmp_path / "a.en")])
    assert f"--out {tmp_path / 'a.en'} would overwrite --train {tmp_path / 'a.en'}" in str(e.value)


def test_a_path_through_a_symlink_is_the_same_path(tmp_path):
    (tmp_path / "W" / "spm").mkdir(parents=True)
    (tmp_path / "W" / "spm" / "train.en").write_text("x\n")
    (tmp_path / "W2").mkdir()
    (tmp_path / "W2" / "spm").symlink_to(tmp_path / "W" / "spm")
    with pytest.raises(
        OutputOverwritesInputError,
        match=r"--out \S*W2/spm/train\.en would overwrite --train \S*W/spm/train\.en \(both are ",
    ):
        check_outputs_spare_inputs(
            {"--out": tmp_path / "W2" / "spm" / "train.en"}, {"--train": tmp_path / "W" / "spm" / "train.en"}
        )
    # a file that does not exist yet, reached through a symlinked folder, too
    with pytest.raises(OutputOverwritesInputError):
        check_outputs_spare_inputs(
            {"--out": tmp_path / "W2" / "spm" / "new"}, {"--train": tmp_path / "W" / "spm" / "new"}
        )


def test_a_relative_path_is_the_same_as_its_absolute_one(tmp_path, monkeypatch):
    (tmp_path / "train.en").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputOverwritesInputError, match="--out ./train.en would overwrite --train "):
        check_outputs_spare_inputs([("--out", "./train.en")], [("--train", tmp_path / "train.en")])


def test_a_hard_link_is_the_same_file(tmp_path):
    (tmp_path / "train.en").write_text("x\n")
    os.link(tmp_path / "train.en", tmp_path / "copy.en")
    with pytest.raises(
        OutputOverwritesInputError, match=r"copy\.en is the same file as --train \S*train\.en \(a hard link\)"
    ):
        check_outputs_spare_inputs([("--out", tmp_path / "copy.en")], [("--train", tmp_path / "train.en")])
    # also when the link lies in a folder the command writes as a whole
    (tmp_path / "bin").mkdir()
    os.link(tmp_path / "train.en", tmp_path / "bin" / "x")
    with pytest.raises(OutputOverwritesInputError, match=r"--out \S*bin \(its \S*bin/x\) is the same file"):
        check_outputs_spare_inputs([("--out", tmp_path / "bin")], [("--train", tmp_path / "train.en")])


def test_folders_stand_for_what_is_under_them(tmp_path):
    with pytest.raises(
        OutputOverwritesInputError,
        match=r"--out \S*out is a folder this command writes, and --data \S*out/raw/train\.en lies inside it",
    ):
        check_outputs_spare_inputs([("--out", tmp_path / "out")], [("--data", tmp_path / "out" / "raw" / "train.en")])
    with pytest.raises(OutputOverwritesInputError, match=r"--out \S*model/x\.json lies inside --model \S*model, which"):
        check_outputs_spare_inputs([("--out", tmp_path / "model" / "x.json")], [("--model", tmp_path / "model")])


def test_distinct_paths_pass(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.en").write_text("x\n")
    (tmp_path / "raw" / "train.ro").write_text("x\n")
    check_outputs_spare_inputs(
        [("--out", tmp_path / "raw" / "train.ro.out"), ("--out", tmp_path / "rawer"), ("--log", None)],
        [("--train", tmp_path / "raw" / "train.en"), ("--valid", tmp_path / "raw" / "train.ro"), ("--test", None)],
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A real prepared folder W: spm/{train,valid}.{en,ro} are encoded text a user may feed back in."""
    root = tmp_path_factory.mktemp("prepared")
    raw = root / "raw"
    train = _pair(raw, "train", *_cut("train", 300), tgt="ro")
    valid = _pair(raw, "valid", *_cut("valid", 20), tgt="ro")
    prep.prepare("en", "ro", {"train": train, "valid": valid}, root / "W", vocab_size=300, log=lambda s: None)
    return root / "W"


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["same-out-without-data-bin", "out-whose-spm-is-a-symlink", "relative-paths"])
def test_re_preparing_encoded_text_into_its_own_folder_is_refused_before_writing(
    prepared, tmp_path, how, capsys, monkeypatch
):
    """Issue 31: --train W/spm/train --out W trained on W/spm/train.en, then truncated it (exit 0)."""
    work = tmp_path / "W"
    shutil.copytree(prepared, work)
    shutil.rmtree(work / "data-bin")  # the guard against an existing data-bin is not what refuses it
    out = work
    if how == "out-whose-spm-is-a-symlink":
        out = tmp_path / "W2"
        out.mkdir()
        (out / "spm").symlink_to(work / "spm")
    before = _snapshot(work)
    train, valid = work / "spm" / "train", work / "spm" / "valid"
    if how == "relative-paths":
        monkeypatch.chdir(tmp_path)
        train, valid, out = Path("W/spm/train"), Path("W/spm/valid"), Path(str(work))
    code, output = _prepare_main(
        ["--src", "en", "--tgt", "ro", "--train", train, "--valid", valid, "--vocab-size", "300", "--out", out], capsys
    )
    assert code == 2, output
    assert output.startswith("attn-reg-prepare: --out "), output
    assert re.search(
        rf"--out {re.escape(str(out / 'spm'))}/\w+\.\w+ would overwrite --(train|valid) {re.escape(str(train.parent))}/",
        output,
    ), output
    assert _snapshot(work) == before  # every input byte for byte, and nothing new
    assert not (out / "data-bin").exists()
    if how == "out-whose-spm-is-a-symlink":
        assert os.listdir(out) == ["spm"]
