"""The generated tables of the docs: every option table of docs/OPTIONS.md (from the configs'
field metadata) and its table of the regularizers that combine (core.combinations) and docs/HF.md's supported-models table (from ``tests/families.py``, the
families the test suite builds).

    .venv/bin/python tests/docs_tables.py docs/OPTIONS.md docs/HF.md

rewrites the table after each ``<!-- options: ConfigName -->``, ``<!-- combinations -->`` and
``<!-- supported models -->`` marker (up to the next blank line); tests fail when a committed table is stale.
"""

from __future__ import annotations

import sys

from attn_reg_plugin.core.regularizers.options import flag_name, options_of


def options_table(config_cls) -> str:
    """The Markdown table of a config's options (docs/OPTIONS.md embeds one per config)."""
    rows = ["| flag | Python | accepted | default | meaning |", "|---|---|---|---|---|"]
    for opt in options_of(config_cls):
        default = "(empty: off)" if opt.default == "" else "(unset)" if opt.default is None else f"`{opt.default}`"
        rows.append(
            f"| `{flag_name(config_cls.FLAG_PREFIX, opt.name)}` | `{config_cls.__name__}.{opt.name}` | "
            f"{opt.accepted.replace('|', chr(92) + '|')} | {default} | {opt.meaning.replace('|', chr(92) + '|')} |"
        )
    return "\n".join(rows)


def _configs():
    """Every registered regularizer's config (an ``<!-- options: ConfigName -->`` marker names one)."""
    from attn_reg_plugin.core.regularizers.registry import registered

    return [regularizer.config for regularizer in registered()]


def _table_for(marker: str):
    """The generated table a marker line asks for, or None for any other line."""
    if marker == "<!-- combinations -->":
        from attn_reg_plugin.core.regularizers.combinations import combinations_table

        return combinations_table()
    if marker == "<!-- supported models -->":
        from families import families_table  # tests/ is this script's folder and pytest's path

        return families_table()
    if marker.startswith("<!-- options: ") and marker.endswith(" -->"):
        by_name = {c.__name__: c for c in _configs()}
        return options_table(by_name[marker[len("<!-- options: ") : -len(" -->")]])
    return None


def with_generated_tables(text: str) -> str:
    """``text`` with the table after each marker line replaced by the generated one."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        out.append(lines[i])
        table = _table_for(lines[i].strip())
        i += 1
        if table is not None:
            out.append(table)
            while i < len(lines) and lines[i].strip():
                i += 1  # the previous table
    return "\n".join(out)


def main(argv=None) -> int:
    for path in sys.argv[1:] if argv is None else argv:
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = with_generated_tables(old)
        if new != old:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        print(f"{path}: {'updated' if new != old else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
