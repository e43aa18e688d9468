"""Tests for attn-reg-build-corpus (attn_reg_lab.build_gettext_corpus) on small .mo catalogs built here."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from attn_reg_lab import build_gettext_corpus as bgc

COMMAND = Path(sys.executable).parent / "attn-reg-build-corpus"  # the console command pyproject.toml declares

HEADER = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=3; plural=(n==1 ? 0 : 1);\n"


def write_mo(path, messages, header=HEADER):
    """Write a GNU .mo file: magic 0x950412de, little-endian, msgids sorted, no hash table.

    ``messages`` maps msgid -> msgstr; a msgid may hold "ctx\\x04id" (context) or
    "one\\x00many" (plural, with msgstr forms joined by "\\x00").
    """
    entries = dict(messages)
    if header is not None:
        entries[""] = header
    items = sorted((k.encode("utf-8"), v.encode("utf-8")) for k, v in entries.items())
    n = len(items)
    orig_table = 7 * 4
    trans_table = orig_table + 8 * n
    data_start = trans_table + 8 * n
    blob = b""
    orig, trans = [], []
    for key, _ in items:
        orig.append((len(key), data_start + len(blob)))
        blob += key + b"\0"
    for _, value in items:
        trans.append((len(value), data_start + len(blob)))
        blob += value + b"\0"
    out = struct.pack("<7I", 0x950412DE, 0, n, orig_table, trans_table, 0, data_start)
    for length, offset in orig + trans:
        out += struct.pack("<2I", length, offset)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(out + blob)


GOOD = {
    "The file could not be opened": "Fișierul nu a putut fi deschis",
    "Show hidden files in the list": "Arată fișierele ascunse în listă",
    "Connection to the server was lost": "Conexiunea la server s-a pierdut",
    "Allow volume above 100%": "Permite volum peste 100%",
    "Whether the secondary icon is sensitive": "Specifică dacă iconița secundară este sensibilă",
    "Printing has been cancelled by the user\n": "Tipărirea a fost anulată de utilizator\n",
}
BAD = {
    # placeholders
    "Cannot open file %s now": "Nu se poate deschide %s acum",
    "Copied %d files so far": "S-au copiat %d fișiere",
    "Move %1$s to %2$s please": "Mută %1$s în %2$s",
    "Value of %(name)s is wrong": "Valoarea %(name)s e greșită",
    "Item {0} was not found": "Elementul {0} nu a fost găsit",
    "Hello {name} and welcome": "Salut {name} și bun venit",
    "Yesterday at %H:%M today": "Ieri la %H:%M azi",
    # markup and entities
    "This is <b>very</b> important": "Asta e <b>foarte</b> important",
    "Sound &amp; Video settings here": "Setări sunet &amp; video",
    # accelerator marks
    "_Open the selected file": "_Deschide fișierul selectat",
    "Save &As another file": "Salvează &ca alt fișier",
    # too short
    "Open file": "Deschide fișier",
    "Quit": "Ieșire",
    # multi-line
    "First line of text\nSecond line of text": "Prima linie de text\nA doua linie de text",
    # option text
    "-v, --verbose print more output": "-v, --verbose afișează mai mult",
    "Use the --force option to continue": "Folosiți opțiunea --force pentru a continua",
    # untranslated
    "This message has no translation": "",
    # plural entry (tuple keys in GNUTranslations._catalog)
    "One file was deleted today\x00Many files were deleted today": "Un fișier\x00Câteva fișiere\x00Multe fișiere",
}


def filler(prefix, count):
    return {f"{prefix} message number {i} here": f"{prefix} mesajul numărul {i} aici" for i in range(count)}


def run_main(capsys, *argv):
    rc = bgc.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def read_split(out, name, lang="ro"):
    en = (out / f"{name}.en").read_text(encoding="utf-8").splitlines()
    tr = (out / f"{name}.{lang}").read_text(encoding="utf-8").splitlines()
    return en, tr


def all_pairs(out, lang="ro"):
    pairs = []
    for name in ("train", "valid", "test"):
        en, tr = read_split(out, name, lang)
        assert len(en) == len(tr)
        pairs += list(zip(en, tr))
    return pairs


@pytest.fixture
def locale_dir(tmp_path):
    root = tmp_path / "locale"
    lc = root / "ro" / "LC_MESSAGES"
    write_mo(lc / "alpha.mo", {**GOOD, **BAD, "ctx\x04Choose a colour for the text": "Alegeți o culoare pentru text"})
    # Same English as alpha.mo with another translation, plus more filler.
    write_mo(lc / "beta.mo", {"The file could not be opened": "ALTĂ TRADUCERE", **filler("Beta", 20)})
    write_mo(lc / "gamma.mo", filler("Gamma", 20))
    (lc / "README.txt").write_text("not a catalog")
    return root


def test_filtering_rules_and_dedup(locale_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, err = run_main(
        capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", out, "--valid", 5, "--test", 5
    )
    assert rc == 0, err
    pairs = all_pairs(out)
    english = [en for en, _ in pairs]
    expected = {k.strip() for k in GOOD} | {"Choose a colour for the text"}
    expected |= set(filler("Beta", 20)) | set(filler("Gamma", 20))
    assert set(english) == expected
    assert len(english) == len(set(english)) == 47
    kept = dict(pairs)
    # First catalog in sorted order wins the duplicate; context prefix is dropped.
    assert kept["The file could not be opened"] == "Fișierul nu a putut fi deschis"
    assert kept["Choose a colour for the text"] == "Alegeți o culoare pentru text"
    # A trailing newline is stripped, not a reason to drop.
    assert kept["Printing has been cancelled by the user"] == "Tipărirea a fost anulată de utilizator"
    assert not any(bad.split("\n")[0].split("\x00")[0] in english for bad in BAD)
    assert "catalogs read: 3" in stdout
    assert "train: 37 pairs" in stdout and "valid: 5 pairs" in stdout and "test: 5 pairs" in stdout
    assert "duplicate English 1" in stdout


def test_split_sizes_and_alignment(locale_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = run_main(capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", out, "--valid", 7, "--test", 4)
    assert rc == 0, err
    sizes = {}
    for name in ("train", "valid", "test"):
        en, tr = read_split(out, name)
        assert len(en) == len(tr)
        sizes[name] = len(en)
        raw = (out / f"{name}.en").read_bytes()
        assert raw.endswith(b"\n") and b"\r" not in raw
    assert sizes == {"train": 36, "valid": 7, "test": 4}
    # Line i of .en is the source of line i of .ro.
    for en, ro in all_pairs(out):
        if en.startswith("Gamma message number"):
            assert ro == en.replace("Gamma message number", "Gamma mesajul numărul").replace(" here", " aici")
    # No pair appears in two splits.
    assert len(set(all_pairs(out))) == 47


def test_min_words(locale_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = run_main(
        capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", out, "--valid", 1, "--test", 1, "--min-words", 2
    )
    assert rc == 0, err
    assert "Open file" in [en for en, _ in all_pairs(out)]


def test_deterministic_for_fixed_seed(locale_dir, tmp_path, capsys):
    outputs = []
    for run, seed in enumerate((3, 3, 4)):
        out = tmp_path / f"out{run}"
        rc, _, err = run_main(
            capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", out, "--valid", 5, "--test", 5, "--seed", seed
        )
        assert rc == 0, err
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    assert sorted(all_pairs(tmp_path / "out0")) == sorted(all_pairs(tmp_path / "out2"))


def test_no_catalogs_for_language(locale_dir, tmp_path, capsys):
    rc, _, err = run_main(capsys, "--lang", "tr", "--locale-dir", locale_dir, "--out", tmp_path / "o")
    assert rc == 1
    assert "no gettext catalogs for language 'tr'" in err
    assert os.path.join("tr", "LC_MESSAGES", "*.mo") in err
    assert not (tmp_path / "o").exists()

    rc, _, err = run_main(capsys, "--lang", "ro", "--locale-dir", tmp_path / "missing", "--out", tmp_path / "o")
    assert rc == 1 and "does not exist" in err


def test_too_few_pairs_for_splits(locale_dir, tmp_path, capsys):
    rc, _, err = run_main(capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", tmp_path / "o")
    assert rc == 1
    assert "only 47 pairs survived filtering" in err


def test_unreadable_catalog_is_skipped(locale_dir, tmp_path, capsys):
    (locale_dir / "ro" / "LC_MESSAGES" / "broken.mo").write_bytes(b"not a mo file at all")
    rc, stdout, err = run_main(
        capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", tmp_path / "o", "--valid", 5, "--test", 5
    )
    assert rc == 0
    assert "skipping unreadable catalog" in err and "broken.mo" in err
    assert "catalogs read: 3 (1 unreadable, skipped)" in stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lang", "ro", "--out", "x", "--valid", "-1"], "must be >= 0"),
        (["--lang", "ro", "--out", "x", "--test", "many"], "expected a whole number"),
        (["--lang", "ro", "--out", "x", "--min-words", "0"], "must be >= 1"),
        (["--lang", "../etc", "--out", "x"], "is not a locale name"),
        (["--lang", "en", "--out", "x"], "source side"),
        (["--lang", "ro"], "--out"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bgc.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_command_line(locale_dir, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            str(COMMAND),
            "--lang",
            "ro",
            "--locale-dir",
            str(locale_dir),
            "--out",
            str(out),
            "--valid",
            "2",
            "--test",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train: 42 pairs" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{s}.{l}" for s in ("train", "valid", "test") for l in ("en", "ro")
    )


def test_exclude_catalogs(locale_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, err = run_main(
        capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", out, "--valid", 2, "--test", 2, "--exclude", "gam*"
    )
    assert rc == 0, err
    assert "catalogs read: 2" in stdout
    assert not any(en.startswith("Gamma") for en, _ in all_pairs(out))
    rc, _, err = run_main(capsys, "--lang", "ro", "--locale-dir", locale_dir, "--out", out, "--exclude", "*.mo")
    assert rc == 1 and "outside --exclude *.mo" in err
