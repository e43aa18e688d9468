"""attn-reg-mt-compare's methods: each is a set of the plugin's fairseq-train arguments, added to the
user's own (``--task attn_reg_translation`` for all), with its own options given by ``--method-args``.

The methods are the regularizer registry's (:mod:`..core.regularizers.comparison_methods`: the plugin's
and any registered outside the package, then the one combination the plugin allows, ``ad-drop-r-drop``),
each turned into fairseq-train arguments by :func:`_fairseq_method`: its criterion (``Method.fairseq_criterion``,
else the plain one with its regularizer's task flags), its defaults (``Method.mt_defaults``: the paper's
where the paper gives one for MT, R-Drop's alpha 5, else the plugin's own) and the flags it requires
(``Method.required``). A method is accepted only when the installed plugin provides its criterion and
task option (:func:`plugin_provides`). A method's ``--method-args`` replace its defaults option by option
and may only name that method's own options (its flag prefixes): a comparison of single regularizers,
each against plain, and of the combination.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..core.regularizers.comparison_methods import ComparisonMethod, comparison_methods, method_table, too_few_epochs
from ..core.regularizers.registry import PLAN, registered
from .options import PLAIN_CRITERION, RefusingParser, SweepError


class Method(NamedTuple):
    criterion: str
    defaults: Tuple[Tuple[str, ...], ...]  # (flag, value...) groups
    prefixes: Tuple[str, ...]  # the flags --method-args may give it
    task_flag: Optional[str]  # the attn_reg_translation option the method needs, if any
    what: str  # for the docs and the refusals
    required: Tuple[str, ...] = ()  # options the user must give (no default fits every run)


def _fairseq_method(method: ComparisonMethod) -> Method:
    """A method as fairseq-train trains it: its criterion (the plain one where its regularizers are the
    task's), the task option it needs (a plan regularizer's switch, or a task regularizer's own, such as
    ``--attendout``), its flag groups and the flags ``--method-args`` may give."""
    switches = [
        r.config.FLAG_PREFIX + r.switch.replace("_", "-") if r.passes == PLAN else part.fairseq_switch
        for r, part in method.parts
    ]
    task_flag = next((switch for switch in switches if switch), None)
    criterion = method.method.fairseq_criterion or PLAIN_CRITERION
    return Method(criterion, method.mt_defaults, method.flag_prefixes, task_flag, method.method.help, method.required)


METHODS: Dict[str, Method] = method_table(
    Method(PLAIN_CRITERION, (), (), None, "label_smoothed_cross_entropy, no regularizer (the reference)"),
    _fairseq_method,
)
# Flags of a method or a regularizer: after '--' they would apply to every method's runs (plain's included).
METHOD_FLAG_PREFIXES = tuple(
    dict.fromkeys(
        [*(p for spec in METHODS.values() for p in spec.prefixes), *(r.config.FLAG_PREFIX for r in registered())]
    )
)
NAME_LIMIT = 60
# A row's name is a folder under runs/ and a file under cells/, and part of fairseq-generate's
# --path, which fairseq splits at os.pathsep (':'): only these characters.
ROW_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._,+=-]*")
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._,+-]+")


class MethodArgs(NamedTuple):
    """A method's ``--method-args``: the row's name when the user gave one, and its options."""

    row: Optional[str]
    groups: List[Tuple[str, ...]]


def parse_methods(text: str, provided: Optional[set], registry: Mapping = METHODS) -> List[str]:
    """``--methods``: a comma list of distinct ``registry`` names, plain among them. A method the plugin
    does not provide at run time (``provided``: :func:`plugin_provides`; None: not checked, as for
    attn-reg-cls-compare's Hugging Face methods) is refused naming the accepted list. Raises
    :class:`SweepError`."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    accepted = [m for m, spec in registry.items() if provided is None or available(spec, provided)]
    unknown = [m for m in names if m not in accepted]
    if unknown:
        why = "; ".join(_why_not(m, provided, registry) for m in unknown)
        raise SweepError(f"--methods {text!r}: {why}; accepted here: {', '.join(accepted)}")
    if len(set(names)) != len(names):
        raise SweepError(f"--methods {text!r} names a method twice")
    if "plain" not in names or len(names) < 2:
        raise SweepError(f"--methods {text!r}: give plain and at least one method to compare with it")
    return ["plain"] + [m for m in names if m != "plain"]


def available(spec: Method, provided: Optional[set]) -> bool:
    needs = [spec.criterion] + ([spec.task_flag] if spec.task_flag else [])
    return provided is None or all(n in provided for n in needs)


def _why_not(name: str, provided: Optional[set], registry: Mapping) -> str:
    if name not in registry:
        return f"{name!r} is not a method"
    spec = METHODS[name]
    needs = [f"fairseq criterion {spec.criterion}"] + ([f"task option {spec.task_flag}"] if spec.task_flag else [])
    missing = [n for n in needs if n.rsplit(" ", 1)[1] not in (provided or ())]
    return f"{name}: the installed plugin has no {' and no '.join(missing)}"


def plugin_provides() -> set:
    """What fairseq-train will accept with the plugin's user dir: the criteria's names and the
    attn_reg_translation task's options (``--attn-sched-dropout-schedule``)."""
    import argparse
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from fairseq import utils  # its import sets the root logger to DEBUG with a handler: undone below
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    from ..user_dir import FAIRSEQ_USER_DIR
    from .options import TASK

    root.setLevel(level)
    root.handlers[:] = handlers
    utils.import_user_module(argparse.Namespace(user_dir=FAIRSEQ_USER_DIR))
    fields = TASK_DATACLASS_REGISTRY[TASK].__dataclass_fields__
    return set(CRITERION_REGISTRY) | {"--" + name.replace("_", "-") for name in fields}


def _groups(words: Sequence[str]) -> List[Tuple[str, ...]]:
    """``--flag value ...`` words as (flag, values...) groups; ``--flag=value`` as (flag, value)."""
    groups: List[List[str]] = []
    for word in words:
        if word.startswith("--"):
            groups.append(word.split("=", 1))
        elif groups:
            groups[-1].append(word)
        else:
            raise SweepError(f"{word!r} is not an option (options start with '--')")
    return [tuple(g) for g in groups]


def parse_method_args(
    values: Sequence[str], methods: Sequence[str], registry: Mapping = METHODS
) -> Dict[str, MethodArgs]:
    """``--method-args METHOD=ARGS`` or ``METHOD:ROW=ARGS`` (repeatable): each method's own options,
    checked against its flag prefixes (``registry[METHOD].prefixes``: attn-reg-mt-compare's
    :data:`METHODS`, attn-reg-cls-compare's ``attn_reg_plugin.hf.methods.METHODS``), and the name of its
    row when given. Raises :class:`SweepError` naming the option."""
    out: Dict[str, MethodArgs] = {}
    for value in values:
        head, sep, text = value.partition("=")
        name, named, row = (part.strip() for part in head.partition(":"))
        where = f"--method-args {value!r}"
        if not sep or name not in registry:
            raise SweepError(
                f"{where}: expected METHOD=ARGS or METHOD:ROW=ARGS with METHOD one of {', '.join(registry)}"
            )
        if named:
            _check_row_name(row, where, registry)
        if name not in methods:
            raise SweepError(f"{where}: {name} is not in --methods ({','.join(methods)})")
        if name in out:
            raise SweepError(f"{where}: {name} has --method-args twice; give its options in one string")
        prefixes = registry[name].prefixes
        try:
            groups = _groups(shlex.split(text))
        except (SweepError, ValueError) as e:
            raise SweepError(f"{where}: {e}") from None
        foreign = [g[0] for g in groups if not g[0].startswith(prefixes)]
        if foreign or not groups:
            own = (
                " or ".join(f"{p}*" for p in prefixes) or "none (plain is the reference; shared options go after '--')"
            )
            raise SweepError(f"{where}: {name}'s options are {own}; got {', '.join(foreign) or 'nothing'}")
        out[name] = MethodArgs(row if named else None, groups)
    return out


def _check_row_name(row: str, where: str, registry: Mapping) -> None:
    if not ROW_NAME.fullmatch(row) or len(row) > NAME_LIMIT:
        raise SweepError(
            f"{where}: row name {row!r} must be 1 to {NAME_LIMIT} of letters, digits and . _ , + = -, starting "
            "with a letter or digit"
        )
    if row in registry:
        raise SweepError(f"{where}: row name {row} is a method's name (its row with its defaults); give another")


def method_cell(name: str, given: Sequence[Tuple[str, ...]], epochs: int, row: Optional[str] = None) -> dict:
    """The cell of ``name`` with its options ``given`` over its defaults: ``{"method", "name",
    "args"}``, named ``row`` when given, else the method's name, plus its options when they differ
    from the defaults (:func:`derived_name`)."""
    spec = METHODS[name]
    merged = {g[0]: g for g in spec.defaults}
    merged.update({g[0]: g for g in given})
    missing = [flag for flag in spec.required if flag not in merged]
    if missing:
        raise SweepError(f"{name} needs {', '.join(missing)} in --method-args: {spec.what}")
    args = ["--criterion", spec.criterion] + [w for g in merged.values() for w in g]
    changed = [g for g in merged.values() if g not in spec.defaults]
    label = row if row is not None else derived_name(name, changed)
    method = comparison_methods().get(name)  # None: plain
    parts = method.parts if method is not None else ()
    configs = {r.key: _config_of(r.config, merged.values()) for r, part in parts if part.min_epochs}
    why = too_few_epochs(method, configs, epochs) if configs else None
    if why:
        raise SweepError(why)
    return {"method": name, "name": label, "args": args}


def _config_of(config_cls, groups):
    """A regularizer's config from a method's fairseq-train flag groups (those of its prefix); a value of
    the wrong type raises :class:`SweepError` naming the flag."""
    from ..core.regularizers.options import add_arguments

    parser = RefusingParser(add_help=False, allow_abbrev=False)
    add_arguments(parser, config_cls)
    words = [w for group in groups if group[0].startswith(config_cls.FLAG_PREFIX) for w in group]
    return config_cls.from_namespace(parser.parse_args(words))


def derived_name(method: str, changed: Sequence[Tuple[str, ...]], registry: Mapping = METHODS) -> str:
    """``method`` and, per option that differs from its defaults, the flag without the method's
    prefix and its value, sign kept: ``r-drop_alpha=-3``, ``ad-drop_p=0.5_q=0.5``. Characters a
    folder name cannot hold safely (':' of schedules) become '_'; a name over NAME_LIMIT ends in a
    hash of the options (results.md lists every row's options in full)."""
    parts = [method]
    for flag, *values in changed:
        prefix = next((p for p in registry[method].prefixes if flag.startswith(p) and flag != p), "--")
        short = flag[len(prefix) :].lstrip("-")
        value = _NOT_IN_NAMES.sub("_", " ".join(values))
        parts.append(f"{short}={value}" if values else short)
    label = "_".join(parts)
    if len(label) > NAME_LIMIT:
        digest = hashlib.sha1(label.encode()).hexdigest()[:8]
        label = f"{label[: NAME_LIMIT - len(digest) - 1]}-{digest}"
    return label


def check_shared_args(train_args: Sequence[str]) -> None:
    """The fairseq-train arguments after '--' are every method's: no method's own flag, no criterion."""
    clash = [
        a.split("=", 1)[0] for a in train_args if a.startswith(METHOD_FLAG_PREFIXES) or a.startswith("--criterion")
    ]
    if clash:
        raise SweepError(
            f"{', '.join(dict.fromkeys(clash))} after '--': the arguments there are every method's, plain's "
            "included; each method sets its criterion, give a method's own options with --method-args METHOD='...'"
        )


def add_methods_options(ap, registry: Mapping, options: str, example: str, named: str) -> None:
    """``--methods`` (a comma list of ``registry``'s names) and ``--method-args`` (attn-reg-mt-compare's and
    -cls-compare's): ``options`` says what a method's options are, ``example`` and ``named`` show one
    and a named row."""
    ap.add_argument("--methods", required=True, help=f"comma list of {', '.join(registry)}, plain among them")
    ap.add_argument(
        "--method-args",
        action="append",
        default=[],
        metavar="METHOD[:ROW]=ARGS",
        help=f"a method's own {options}, e.g. '{example}' (repeatable; they replace its defaults); its row is "
        f"named after them, or ROW: '{named}'",
    )
