"""No command writes to a path it reads: :func:`check_outputs_spare_inputs`.

A command that reads ``--train W/spm/train.en`` and writes ``--out W`` (whose ``spm/train.en``
is that very file, or a symlink or hard link to it) would truncate its own input before reading
it, and could still exit 0. Every command of the plugin and the lab checks its outputs against
its inputs with this function before it writes anything; the error names both options and paths.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]
Named = Union[Mapping[str, Optional[PathLike]], Iterable[Tuple[str, Optional[PathLike]]]]


class OutputOverwritesInputError(ValueError):
    """An output path is (or holds, or lies in) an input path; the message names both and their options."""


def _pairs(named: Named) -> Iterator[Tuple[str, str]]:
    items = named.items() if isinstance(named, Mapping) else named
    for name, path in items:
        if path is not None:
            yield name, os.fspath(path)


def _inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies under it (both absolute, symlinks resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _files(path: str) -> Iterator[str]:
    """``path`` if it is an existing file, every file under it if it is a folder, else nothing."""
    if os.path.isdir(path):
        for root, _dirs, names in os.walk(path):
            for name in names:
                yield os.path.join(root, name)
    elif os.path.exists(path):
        yield path


def _identity(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_outputs_spare_inputs(outputs: Named, inputs: Named) -> None:
    """Raise :class:`OutputOverwritesInputError` if writing any of ``outputs`` could change any of ``inputs``.

    Both are ``(option, path)`` pairs (or a mapping option -> path; ``None`` paths are skipped),
    e.g. ``[("--out", "W/spm/train.en")]`` against ``[("--train", "W/spm/train.en")]``. Paths
    are compared after resolving relative paths and symlinks (:func:`os.path.realpath`), and
    existing files also by identity (device and inode: a hard link is the same file). A folder
    among the outputs stands for everything under it (a folder the command fills or clears), a
    folder among the inputs for everything under it it reads: an input inside an output folder,
    or an output inside an input folder, is refused too. Call it before anything is written.
    """
    outs = list(_pairs(outputs))
    ins = list(_pairs(inputs))
    real_ins = [(name, path, os.path.realpath(path)) for name, path in ins]
    for out_name, out in outs:
        real_out = os.path.realpath(out)
        for in_name, inp, real_in in real_ins:
            if real_out == real_in:
                same = "" if os.path.abspath(out) == os.path.abspath(inp) else f" (both are {real_out})"
                raise OutputOverwritesInputError(
                    f"{out_name} {out} would overwrite {in_name} {inp}{same}: a command never writes a file it "
                    f"reads; choose another {out_name}"
                )
            resolved = os.path.abspath(out) != real_out or os.path.abspath(inp) != real_in
            if _inside(real_in, real_out):
                where = f" ({real_in} in {real_out})" if resolved else ""
                raise OutputOverwritesInputError(
                    f"{out_name} {out} is a folder this command writes, and {in_name} {inp} lies inside it"
                    f"{where}: choose another {out_name} or move the input"
                )
            if _inside(real_out, real_in):
                where = f" ({real_out} in {real_in})" if resolved else ""
                raise OutputOverwritesInputError(
                    f"{out_name} {out} lies inside {in_name} {inp}, which this command reads{where}: "
                    f"choose another {out_name}"
                )
    # Hard links (and anything else realpath cannot see, e.g. bind mounts): existing files by identity.
    identities: Dict[Tuple[int, int], Tuple[str, str, str]] = {}
    for in_name, inp in ins:
        for file in _files(inp):
            key = _identity(file)
            if key is not None:
                identities.setdefault(key, (in_name, inp, file))
    if not identities:
        return
    for out_name, out in outs:
        for file in _files(out):
            hit = identities.get(_identity(file))
            if hit is not None:
                in_name, inp, in_file = hit
                where = "" if file == out else f" (its {file})"
                of = "" if in_file == inp else f" (its {in_file})"
                raise OutputOverwritesInputError(
                    f"{out_name} {out}{where} is the same file as {in_name} {inp}{of} (a hard link): "
                    f"a command never writes a file it reads; choose another {out_name}"
                )
