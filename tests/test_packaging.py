"""The plugin's wheel is the plugin, and the lab stays beside it.

The plugin's distribution (``pyproject.toml``) ships ``attn_reg_plugin`` and the commands a plugin
user needs; the lab is a second distribution (``lab/pyproject.toml``). Nothing outside the lab
imports it, and the lab uses only the plugin's public names.
"""

import ast
import configparser
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from helpers import REPO

PLUGIN_COMMANDS = {
    "attn-reg-prepare": "attn_reg_plugin.prepare:main",
    "attn-reg-prepare-cls": "attn_reg_plugin.prepare_classification:main",
    "attn-reg-user-dir": "attn_reg_plugin.user_dir:main",
    "attn-reg-mt-sweep": "attn_reg_plugin.sweep:main",
    "attn-reg-mt-compare": "attn_reg_plugin.sweep.compare:main",
    "attn-reg-cls-compare": "attn_reg_plugin.sweep.cls_compare:main",
    "attn-reg-average-checkpoints": "attn_reg_plugin.average_checkpoints:main",
}
# What a build must not see: local environments, outputs and build leftovers.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "outputs", "work", "runs", "checkpoints", "build", "dist", "*.egg-info", "__pycache__", ".*cache"
)


def build_wheel(project: Path, tmp_path: Path) -> Path:
    """``pip wheel`` of a copy of ``project`` (a build writes build/ and egg-info beside the sources)."""
    source = tmp_path / "source"
    shutil.copytree(project, source, ignore=NOT_SOURCE)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = dist.glob("*.whl")
    return wheel


def console_scripts(wheel: zipfile.ZipFile) -> dict:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    entry_points = configparser.ConfigParser(delimiters=("=",))
    entry_points.optionxform = str  # command names keep their case
    entry_points.read_string(wheel.read(name).decode("utf-8"))
    return dict(entry_points["console_scripts"])


def test_plugin_wheel_holds_the_plugin_and_its_commands_only(tmp_path):
    with zipfile.ZipFile(build_wheel(REPO, tmp_path)) as wheel:
        names = wheel.namelist()
        packaged = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert packaged, names
        assert {n.split("/")[0] for n in packaged} == {"attn_reg_plugin"}, sorted(packaged)
        sources = {p.relative_to(REPO).as_posix() for p in (REPO / "attn_reg_plugin").rglob("*.py")}
        assert sources <= packaged, f"missing from the wheel: {sorted(sources - packaged)}"
        assert console_scripts(wheel) == PLUGIN_COMMANDS


def test_the_installed_version_is_the_changelogs():
    """pyproject.toml, ``attn_reg_plugin.__version__`` and the installed distribution all name the version
    of CHANGELOG.md's top heading (the install said 0.2.0 while the docs described 0.3.0)."""
    import attn_reg_plugin

    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    top = re.search(r"^## (\d+\.\d+\.\d+)\b", changelog, flags=re.M).group(1)
    project = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(encoding="utf-8"), flags=re.M)
    assert (project.group(1), attn_reg_plugin.__version__) == (top, top)
    installed = metadata.version("attn_reg_plugin")
    assert installed == top, f"the venv holds attn_reg_plugin {installed}: reinstall it (make .venv)"


def test_lab_wheel_holds_the_lab_and_its_commands(tmp_path):
    with zipfile.ZipFile(build_wheel(REPO / "lab", tmp_path)) as wheel:
        packaged = {n for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
        assert {n.split("/")[0] for n in packaged} == {"attn_reg_lab"}, sorted(packaged)
        commands = console_scripts(wheel)
    assert commands and not set(commands) & set(PLUGIN_COMMANDS)
    assert all(target.startswith("attn_reg_lab.") for target in commands.values()), commands
    assert {"attn-reg-demo", "attn-reg-scaling", "attn-reg-sweep", "attn-reg-regime", "attn-reg-fig2"} <= set(commands)


def imports(path: Path):
    """(module, names) of every import statement in ``path``; names is None for ``import module``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [alias.name for alias in node.names]


def python_files(*folders: str):
    for folder in folders:
        yield from sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["attn_reg_plugin", "examples", "tests"])
def test_nothing_outside_the_lab_imports_the_lab(folder):
    lab_tests = REPO / "tests" / "lab"
    offenders = [
        f"{path.relative_to(REPO)}: {module}"
        for path in python_files(folder)
        if lab_tests not in path.parents
        for module, _ in imports(path)
        if module.split(".")[0] == "attn_reg_lab"
    ]
    assert offenders == []


def test_the_lab_imports_no_private_plugin_name():
    offenders = [
        f"{path.relative_to(REPO)}: {module}: {name}"
        for path in python_files("lab/attn_reg_lab")
        for module, names in imports(path)
        if module.split(".")[0] == "attn_reg_plugin"
        for name in [*module.split(".")[1:], *(names or [])]
        if name.startswith("_") and not name.startswith("__")
    ]
    assert offenders == []


def plugin_imports(path: Path, text=None):
    """(module, name, line) of each ``from attn_reg_plugin... import name`` in ``path`` (or in
    ``text``, as if it were that file's), relative imports resolved against the file's package."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8") if text is None else text)):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] == "attn_reg_plugin":
                yield from ((module, alias.name, node.lineno) for alias in node.names)


def top_level_names(path: Path) -> set:
    """Names a module defines: its functions, classes and assignments, also under an if or a try."""
    names, statements = set(), list(ast.parse(path.read_text(encoding="utf-8")).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):  # their branches' statements, not the functions' bodies
            statements += node.body + node.orelse + getattr(node, "finalbody", [])
            statements += [s for handler in getattr(node, "handlers", []) for s in handler.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_plugin_names_are_imported_from_the_module_that_defines_them():
    """design.md "One import path per name": a plugin module's name is imported from the module
    that defines it, never through one that merely imports it; packages (``__init__``) gather."""
    offenders = []
    for path in python_files("attn_reg_plugin", "lab", "tests", "examples", "tools"):
        for module, name, line in plugin_imports(path):
            file = REPO.joinpath(*module.split(".")).with_suffix(".py")
            submodule = REPO.joinpath(*module.split("."), name)
            if file.exists() and name not in top_level_names(file) and not submodule.with_suffix(".py").exists():
                offenders.append(f"{path.relative_to(REPO)}:{line}: {name} from {module}")
    assert offenders == []


def test_the_checks_above_see_what_they_look_for(tmp_path):
    """The import walker finds both spellings, so an empty offender list means no import."""
    sample = tmp_path / "sample.py"
    sample.write_text("import attn_reg_lab.demo\nfrom attn_reg_plugin.core.kernel.attention import _captured\n")
    assert list(imports(sample)) == [
        ("attn_reg_lab.demo", None),
        ("attn_reg_plugin.core.kernel.attention", ["_captured"]),
    ]
    inside = REPO / "attn_reg_plugin" / "core" / "kernel" / "sample.py"  # never written: only its path is read
    assert ("attn_reg_plugin.core.kernel.attention_call", "EditScores") == next(
        (m, n) for m, n, _ in plugin_imports(inside, "from .attention_call import EditScores\n")
    )
    assert "EditScores" not in top_level_names(REPO / "attn_reg_plugin" / "core" / "kernel" / "controller.py")
    assert "EditScores" in top_level_names(REPO / "attn_reg_plugin" / "core" / "kernel" / "attention_call.py")
