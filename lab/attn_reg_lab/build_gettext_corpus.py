#!/usr/bin/env python3
"""Build an English->LANG parallel corpus from a machine's gettext catalogs.

Every Debian/Ubuntu system ships the human translations of its software messages as
compiled gettext catalogs under ``/usr/share/locale/<lang>/LC_MESSAGES/*.mo`` (GTK,
GLib, xkeyboard-config, coreutils, apt, dpkg, systemd, ...).  This script reads all of
them for one language with the standard library's ``gettext.GNUTranslations`` and turns
them into a small, clean, sentence-aligned corpus of short software UI strings.  That is
how ``data/gettext_en_ro/`` was made, and it works the same for ``tr``, ``de``, ``fr``
or any other language the machine has catalogs for.

Usage::

    attn-reg-build-corpus --lang ro --out /tmp/gettext_en_ro
    attn-reg-build-corpus --lang tr --out data/gettext_en_tr \\
        --valid 500 --test 1000 --seed 1 --min-words 3

Options: ``--locale-dir`` (default ``/usr/share/locale``), ``--valid N`` (500),
``--test N`` (1000), ``--seed`` (1), ``--min-words`` (3), and ``--exclude GLOB``
(repeatable; skips catalogs by file name, e.g. ``--exclude 'iso_*'`` leaves out the
iso-codes lists of country, language and currency names, which the shipped
``data/gettext_en_ro`` does not contain).  More catalogs (and so
more sentences) are available after installing more packages and the language's
``language-pack-*`` / ``*-l10n`` packages; Debian's ``localepurge`` removes them.

What is kept (each rule applies to both the English and the translated side):

* ordinary entries only: the header entry (empty msgid) and plural entries (whose
  keys are ``(msgid, n)`` tuples) are skipped; a ``msgctxt`` prefix is dropped;
* translated entries only: empty translations are skipped (fuzzy entries are never
  in a .mo file unless ``msgfmt --use-fuzzy`` put them there, which cannot be told
  apart afterwards);
* one-line messages: leading and trailing whitespace (a final ``\\n`` included) is
  stripped from both sides, then a message with a newline, tab or any other control
  character left on either side is dropped;
* at least ``--min-words`` whitespace-separated English words;
* no printf-style or format placeholders (``%s``, ``%d``, ``%1$s``, ``%(name)s``,
  ``%<PRIu64>``, strftime's ``%H:%M``, ``{0}``, ``{name}``, ``{}``);
* no markup (``<b>``, ``</a>``, ``<span ...>``) and no entities (``&amp;``);
* no accelerator marks (``_`` or ``&`` before a letter, as in ``_Open`` or ``&Save``;
  this also drops identifiers such as ``max_width``);
* no option text (a message starting with ``-`` or ``[-``, or containing `` --``).

Duplicates of the English side are dropped, keeping the first one in sorted order of
catalog file name and then msgid, so the result does not depend on the file system.
The pairs are shuffled with ``random.Random(seed)``; the first ``--valid`` pairs form
the validation split, the next ``--test`` pairs the test split, the rest the training
split.  Files written: ``{train,valid,test}.en`` and ``{train,valid,test}.<lang>``,
UTF-8, one sentence per line, line i of one side aligned with line i of the other.

Licensing caveat: the output is not this project's work.  Each sentence and its
translation stay under the licence of the package whose catalog they came from (mostly
GPL-2+ or LGPL-2.1+; some catalogs, e.g. iso-codes or xkeyboard-config, use other free
licences), written and translated by those projects' contributors.  Anyone who ships a
corpus built with this script must ship a NOTICE naming that provenance; see
``data/gettext_en_ro/NOTICE`` for an example.

Standard library only; Python 3.8+.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import gettext
import os
import random
import re
import sys
import unicodedata

# printf conversions, with optional argument index (%1$s), flags, width, precision and
# length modifier.  The space flag is left out on purpose: "50% done" is prose.
_PRINTF = re.compile(
    r"%(?:\d+\$)?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?"
    r"(?:hh|h|ll|l|L|q|j|z|Z|t|I64|I32|I)?[diouxXeEfFgGaAcCsSpnm%]"
)
_PY_PERCENT = re.compile(r"%\([^()\s]*\)")  # %(name)s
_INTTYPES = re.compile(r"%<\w+>")  # gettext's %<PRIu64>
_STRFTIME = re.compile(r"%[-_0^#]?[EO]?[A-Za-z+]")  # %H:%M, %-d, %Ey
_BRACE = re.compile(r"\{[^{}\s]*\}")  # {0}, {name}, {}, {0:>5}
_MARKUP = re.compile(r"</?[A-Za-z][^<>]*>")
_ENTITY = re.compile(r"&(?:[A-Za-z]+|#\d+|#x[0-9A-Fa-f]+);")
# A letter (any script) right after "_" or "&": GTK/Qt mnemonics such as "_Open".
_ACCEL = re.compile(r"[_&][^\W\d_]")

LANG_RE = re.compile(r"^[A-Za-z]{2,3}(?:_[A-Za-z]{2})?(?:@[A-Za-z0-9]+)?$")
SPLITS = ("train", "valid", "test")


class CorpusError(Exception):
    """A condition that stops the build with a clear message."""


def has_placeholder(text: str) -> bool:
    return bool(
        _PRINTF.search(text)
        or _PY_PERCENT.search(text)
        or _INTTYPES.search(text)
        or _STRFTIME.search(text)
        or _BRACE.search(text)
    )


def has_markup(text: str) -> bool:
    return bool(_MARKUP.search(text) or _ENTITY.search(text))


def has_accelerator(text: str) -> bool:
    return bool(_ACCEL.search(text))


def is_option_text(text: str) -> bool:
    return text.lstrip(" [").startswith("-") or " --" in text


def is_one_line(text: str) -> bool:
    return not any(unicodedata.category(ch) == "Cc" for ch in text)


def reject_reason(english: str, translation: str, min_words: int) -> str | None:
    """Why a (msgid, msgstr) pair is dropped, or None when it is kept."""
    if not translation.strip():
        return "untranslated"
    if not (is_one_line(english) and is_one_line(translation)):
        return "multi-line"
    if len(english.split()) < min_words:
        return "too short"
    for side in (english, translation):
        if has_placeholder(side):
            return "placeholder"
        if has_markup(side):
            return "markup"
        if has_accelerator(side):
            return "accelerator"
        if is_option_text(side):
            return "option text"
    return None


def find_catalogs(locale_dir: str, lang: str, exclude=()) -> list[str]:
    folder = os.path.join(locale_dir, lang, "LC_MESSAGES")
    if not os.path.isdir(folder):
        return []
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.endswith(".mo")
        and os.path.isfile(os.path.join(folder, name))
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)
    )


def read_catalog(path: str) -> dict:
    with open(path, "rb") as fp:
        return gettext.GNUTranslations(fp)._catalog


def collect_pairs(catalogs: list[str], min_words: int, stats: collections.Counter):
    """Filtered, English-deduplicated pairs, in catalog-then-msgid order."""
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path in catalogs:
        try:
            catalog = read_catalog(path)
        except (OSError, UnicodeError, ValueError, LookupError) as exc:
            print(f"warning: skipping unreadable catalog {path}: {exc}", file=sys.stderr)
            stats["unreadable catalogs"] += 1
            continue
        stats["catalogs"] += 1
        entries = []
        for key, value in catalog.items():
            if not isinstance(key, str):  # plural forms: (msgid, n)
                stats["plural"] += 1
                continue
            if key == "":  # header
                continue
            msgid = key.rsplit("\x04", 1)[-1]  # drop a msgctxt prefix
            if not msgid:
                continue
            entries.append((msgid, key, value))
        entries.sort()
        for msgid, _key, msgstr in entries:
            english, translation = msgid.strip(), msgstr.strip()
            reason = reject_reason(english, translation, min_words)
            if reason is not None:
                stats[reason] += 1
                continue
            if english in seen:
                stats["duplicate English"] += 1
                continue
            seen.add(english)
            pairs.append((english, translation))
    return pairs


def split_pairs(pairs, n_valid: int, n_test: int, seed: int):
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    valid = shuffled[:n_valid]
    test = shuffled[n_valid : n_valid + n_test]
    train = shuffled[n_valid + n_test :]
    return {"train": train, "valid": valid, "test": test}


def write_splits(out_dir: str, lang: str, splits) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name in SPLITS:
        for index, suffix in ((0, "en"), (1, lang)):
            path = os.path.join(out_dir, f"{name}.{suffix}")
            with open(path, "w", encoding="utf-8", newline="\n") as fp:
                for pair in splits[name]:
                    fp.write(pair[index] + "\n")


def build(lang, locale_dir, out_dir, n_valid=500, n_test=1000, seed=1, min_words=3, exclude=()):
    """Build the corpus; returns (splits, stats). Raises CorpusError."""
    if not os.path.isdir(locale_dir):
        raise CorpusError(f"locale directory {locale_dir!r} does not exist")
    catalogs = find_catalogs(locale_dir, lang, exclude)
    if not catalogs:
        raise CorpusError(
            f"no gettext catalogs for language {lang!r}: nothing matches "
            f"{os.path.join(locale_dir, lang, 'LC_MESSAGES', '*.mo')}"
            + (f" outside --exclude {' '.join(exclude)}" if exclude else "")
            + " "
            "(install the language's translations, e.g. its language-pack or l10n "
            "packages, or pick a language listed under the locale directory)"
        )
    stats: collections.Counter = collections.Counter()
    pairs = collect_pairs(catalogs, min_words, stats)
    if stats["catalogs"] == 0:
        raise CorpusError(f"none of the {len(catalogs)} catalogs for {lang!r} could be read")
    if len(pairs) <= n_valid + n_test:
        raise CorpusError(
            f"only {len(pairs)} pairs survived filtering for {lang!r}, not enough for "
            f"--valid {n_valid} + --test {n_test} and a non-empty training split; "
            "lower --valid/--test or --min-words"
        )
    splits = split_pairs(pairs, n_valid, n_test, seed)
    write_splits(out_dir, lang, splits)
    return splits, stats


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _lang(text: str) -> str:
    if not LANG_RE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a locale name such as ro, tr, pt_BR or sr@latin")
    if text == "en":
        raise argparse.ArgumentTypeError("'en' is the source side; pick the target language (e.g. ro, tr, en_GB)")
    return text


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="build_gettext_corpus.py",
        description="Build an English->LANG parallel corpus from the gettext catalogs "
        "(LOCALE_DIR/LANG/LC_MESSAGES/*.mo) of a Debian/Ubuntu machine. The output "
        "inherits the licences of the source packages.",
    )
    parser.add_argument(
        "--lang",
        required=True,
        type=_lang,
        help="target language as named under the locale directory (ro, tr, pt_BR, ...)",
    )
    parser.add_argument(
        "--locale-dir",
        default="/usr/share/locale",
        help="directory holding <lang>/LC_MESSAGES/*.mo (default: %(default)s)",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--valid", type=_non_negative_int, default=500, help="validation pairs (default: %(default)s)")
    parser.add_argument("--test", type=_non_negative_int, default=1000, help="test pairs (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="shuffle seed (default: %(default)s)")
    parser.add_argument(
        "--min-words", type=_positive_int, default=3, help="minimum English words per message (default: %(default)s)"
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip catalogs whose file name matches GLOB, e.g. 'iso_*' (country/language/currency names); repeatable",
    )
    return parser


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        splits, stats = build(
            args.lang, args.locale_dir, args.out, args.valid, args.test, args.seed, args.min_words, args.exclude
        )
    except CorpusError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"catalogs read: {stats['catalogs']}"
        + (f" ({stats['unreadable catalogs']} unreadable, skipped)" if stats["unreadable catalogs"] else "")
    )
    dropped = ", ".join(
        f"{reason} {count}"
        for reason, count in sorted(stats.items())
        if reason not in ("catalogs", "unreadable catalogs")
    )
    print(f"dropped: {dropped or 'none'}")
    for name in SPLITS:
        print(f"{name}: {len(splits[name])} pairs")
    print(f"total: {sum(len(s) for s in splits.values())} pairs -> {args.out} ({{train,valid,test}}.en / .{args.lang})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
