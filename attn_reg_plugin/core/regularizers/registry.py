"""A regularizer is one object, registered once; everything that offers regularizers loops over the registry.

A :class:`Regularizer` declares what the adapters and the comparison commands need to know about it:

- its options: a :class:`~.options.RegularizerOptions` dataclass (declared once; fairseq flags, HF
  keywords and the comparison commands' flags all come from it);
- how it trains (``passes``): a plan regularizer (:data:`PLAN`) edits the attention calls of the training
  forward: ``build(config, controller)`` returns its running object, whose ``hooks(update)`` are the plan
  set around one training step (the attn_reg task's ``train_step``, ``AttnRegTrainer.compute_loss``) and
  whose ``logged(update)`` are the numbers it logs beside its rate, ``counted[0] / counted[1]`` as the
  kernel counted them where it applied the edits (``log_prefix + "_rate"``). A regularizer of its own
  passes (:data:`OWN_PASSES`: AD-DROP, AttendOut, R-Drop, HiddenCut) runs them in the fairseq criterion
  (AttendOut: the task) and the Trainer its methods name; one whose passes are a step over the
  framework's (R-Drop, HiddenCut) declares it (``step``) and what it logs (``logged``), and those adapters
  only run it (:mod:`.training_step`);
- what it cannot be combined with: every pair is refused unless :mod:`.combinations` lists it;
- its defaults as a method of ``attn-reg-mt-compare`` and ``attn-reg-cls-compare`` (:class:`Method`),
  and how each framework trains it there.

The fairseq task (``--attn-...`` flags, ``train_step``, the metrics), ``AttnRegTrainer`` (its keywords),
both comparison commands' method tables (:mod:`.comparison_methods`), the combination check and the
idle-run warning read :func:`registered` (or :func:`planned`, its plan regularizers); a new regularizer
is one file and one :func:`register` call. A file outside the package is loaded by naming it in
``ATTN_REG_EXTENSIONS`` (paths or module names, separated by ``os.pathsep`` or commas): the plugin
imports it before it builds fairseq's task options, in every process that imports the plugin
(fairseq-train, the comparison commands' runs). docs/PORTING.md#your-own-regularizer.

The plugin's regularizers register themselves, each from its own module (:data:`PLUGIN_MODULES`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

EXTENSIONS_ENV = "ATTN_REG_EXTENSIONS"


@dataclass(frozen=True)
class Method:
    """A regularizer as a method of the comparison commands.

    ``defaults``: its config's field values for attn-reg-cls-compare's classifiers (the config's own
    defaults otherwise); ``mt_defaults``: fairseq-train flag groups for attn-reg-mt-compare (``(flag,
    value)``); ``required``: flags the user must give in MT (no default fits every run's length);
    ``check(config)``: raises ValueError (naming the option) when the config is not this method;
    ``min_epochs(config)``: the fewest epochs in which it does anything (AD-DROP's cross-tuning: 2), and
    ``epochs_advice(config)``: the setting that needs them and the one that needs fewer, as the user writes
    them (``("--ad-drop-schedule cross-tuning", "--ad-drop-schedule always")``);
    ``recorded(config)``: the fields a run records of its config (all of them otherwise).

    How each framework trains it: ``fairseq_criterion``, the translation criterion (None: the attn_reg
    task's flags under label_smoothed_cross_entropy), ``fairseq_switch``, the task flag that turns on a
    regularizer of its own passes that the task runs (AttendOut's ``--attendout``; a one-pass
    regularizer's is its switch); ``trainer``, the Trainer class, given each regularizer's config by its
    key: a name in :mod:`attn_reg_plugin.hf`, or ``"module:Class"`` for one of your own; ``heldout``: the
    trainer draws held-out samples from the dev set. A regularizer of its own passes must name its
    criterion (or switch) and its trainer: :func:`register` refuses it otherwise.
    ``flag_prefixes``: the flags ``--method-args`` may give it (its config's prefix otherwise);
    ``log_keys``: the Trainer log keys a run records (None: its regularizer's)."""

    name: str
    help: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    mt_defaults: Tuple[Tuple[str, ...], ...] = ()
    required: Tuple[str, ...] = ()
    check: Optional[Callable[[Any], None]] = None
    min_epochs: Optional[Callable[[Any], int]] = None
    epochs_advice: Optional[Callable[[Any], Tuple[str, str]]] = None
    recorded: Optional[Callable[[Any], dict]] = None
    fairseq_criterion: Optional[str] = None
    fairseq_switch: Optional[str] = None
    trainer: str = "AttnRegTrainer"
    heldout: bool = False
    flag_prefixes: Tuple[str, ...] = ()
    log_keys: Optional[Tuple[str, ...]] = None


# How a regularizer trains. PLAN: it edits the attention calls of the training forward, its plan set
# around the step (the attn_reg task's flags, AttnRegTrainer's keyword). OWN_PASSES: it runs passes of
# its own (AD-DROP's attribution pass, R-Drop's and HiddenCut's second pass, AttendOut's Attacker), in a
# fairseq criterion (AttendOut: the task) and a Trainer of its own, named by its methods.
PLAN = "plan"
OWN_PASSES = "own passes"


@dataclass(frozen=True)
class Regularizer:
    """One regularizer: its options, how it trains, its log and its methods.

    ``key``: the HF trainers' keyword (``AttnRegTrainer(layerdrop=AttentionLayerDropConfig(...))``,
    ``ADDropTrainer(ad_drop=ADDropConfig(...))``) and the name the adapters keep it under. ``name``: as
    the papers name it, in messages; ``named(config)`` may name a variant (DropKey is scheduled
    dropout's ``dropkey:RATE``). ``passes``: :data:`PLAN` or :data:`OWN_PASSES`. A plan regularizer's
    ``switch`` is the config field that turns it on (a config is on when ``config.enabled``) and
    ``build(config, controller)`` its running object (``.config``, ``.sites``, ``.hooks(update)``,
    ``.logged(update)``); ``counted``: the names of the two counts the kernel returns, logged in fairseq
    as ``log_prefix + "_" + name``; ``counts_calls``: they count layer calls (a call made uniform), not
    units. A regularizer of its own passes is turned on by choosing its criterion or Trainer (no
    switch, nothing built here). ``variants``: every name ``named`` may give. ``idle(config, epochs,
    updates, plan)``: the warning for a planned run in which it never acts, or None (unset: a plan
    regularizer's schedule says, :mod:`.planned_run`). ``step(config, training_step, sites)``: the
    training step of a regularizer of its own passes that runs over any framework's step
    (:mod:`.training_step`; R-Drop, HiddenCut), ``sites`` what the framework built for it (HiddenCut's
    :class:`~.hiddencut.CutSites`); ``logged``: the :class:`~.training_step.Logged` numbers the adapters
    reduce from its steps' sums. ``active_key``: a log key that reads 0 for an epoch in which it does
    nothing by design (AD-DROP's plain epochs of cross-tuning): reports leave such epochs out of its
    mean drop rate."""

    key: str
    name: str
    config: type
    switch: str
    build: Optional[Callable[[Any, Any], Any]]
    log_prefix: str
    counted: Tuple[str, str] = ("dropped", "units")
    counts_calls: bool = False
    methods: Tuple[Method, ...] = ()
    named: Optional[Callable[[Any], str]] = None
    variants: Tuple[str, ...] = ()
    passes: str = PLAN
    idle: Optional[Callable[[Any, Optional[int], Optional[int], str], Optional[str]]] = None
    step: Optional[Callable[[Any, Any, Any], Any]] = None
    logged: Tuple[Any, ...] = ()
    active_key: Optional[str] = None

    def name_of(self, config) -> str:
        """The regularizer ``config`` turns on, as :mod:`.combinations` names it."""
        return self.named(config) if self.named is not None else self.name

    @property
    def names(self) -> Tuple[str, ...]:
        return (self.name, *self.variants)

    def counts(self, record) -> list:
        """[done, of] for one pass, as the kernel counted them (tensors: no host read)."""
        return record.calls() if self.counts_calls else record.counts()

    def rate_key(self) -> str:
        return f"{self.log_prefix}_rate"

    def log_keys(self) -> Tuple[str, ...]:
        """The keys a run's training logs have for it (``*``: a prefix), in HF and fairseq alike: a step's
        ``logged`` numbers, else the rate and the prefix."""
        if self.logged:
            return tuple(number.name for number in self.logged)
        return (self.rate_key(), f"{self.log_prefix}_*")


_REGISTRY: Dict[str, Regularizer] = {}
_FLAG = re.compile(r"[a-z][a-z0-9_]*")


def register(regularizer: Regularizer) -> Regularizer:
    """Add ``regularizer`` to the registry (every adapter and command that loops over regularizers sees
    it). Refused, naming the clash, when its key, a name, a method or a flag prefix is already taken."""
    if regularizer.passes not in (PLAN, OWN_PASSES):
        raise ValueError(f"Regularizer.passes must be {PLAN!r} or {OWN_PASSES!r}, got {regularizer.passes!r}")
    if regularizer.passes == PLAN and (regularizer.build is None or not regularizer.switch):
        raise ValueError(f"regularizer {regularizer.name!r}: a plan regularizer needs its switch and build")
    if not _FLAG.fullmatch(regularizer.key):
        raise ValueError(f"Regularizer.key must be a Python keyword-like name (a-z, 0-9, _), got {regularizer.key!r}")
    for method in regularizer.methods:
        _check_method(regularizer, method)
    for other in _REGISTRY.values():
        clashes = {
            "key": regularizer.key == other.key,
            "name": bool(set(regularizer.names) & set(other.names)),
            "method": bool({m.name for m in regularizer.methods} & {m.name for m in other.methods}),
            "flag prefix": regularizer.config.FLAG_PREFIX == other.config.FLAG_PREFIX,
            "log prefix": regularizer.log_prefix == other.log_prefix,
        }
        taken = [what for what, clash in clashes.items() if clash]
        if taken:
            raise ValueError(
                f"regularizer {regularizer.name!r}: its {', '.join(taken)} already belong to {other.name!r}"
            )
    _REGISTRY[regularizer.key] = regularizer
    _ordered.cache_clear()
    return regularizer


# The comparison commands' reference: no regularizer's method may take its name.
PLAIN_METHOD = "plain"


def _check_method(regularizer: Regularizer, method: Method) -> None:
    """A method both comparison commands can train: not named as their reference, and, for a regularizer
    of its own passes, naming what trains it in each framework (a plan regularizer's is the attn_reg task's
    flags and AttnRegTrainer)."""
    where = f"regularizer {regularizer.name!r}, method {method.name!r}"
    if method.name == PLAIN_METHOD:
        raise ValueError(f"{where}: {PLAIN_METHOD!r} is the comparison commands' reference; name the method otherwise")
    if regularizer.passes == OWN_PASSES:
        if not (method.fairseq_criterion or method.fairseq_switch):
            raise ValueError(
                f"{where}: a regularizer of its own passes names what trains it in fairseq "
                "(Method.fairseq_criterion, or Method.fairseq_switch for one bound to the attn_reg task)"
            )
        if method.trainer == "AttnRegTrainer":
            raise ValueError(
                f"{where}: a regularizer of its own passes names the Trainer that runs them (Method.trainer); "
                "AttnRegTrainer runs plan regularizers only"
            )


def _order(regularizer: Regularizer) -> Tuple[int, int, int]:
    """Those of their own passes first, then the plan regularizers; within each, the plugin's in
    :data:`PLUGIN_MODULES`' order (whichever was imported first), then the others as registered."""
    module = regularizer.config.__module__
    home = module[len(__package__) + 1 :] if module.startswith(__package__ + ".") else None
    plugin = PLUGIN_MODULES.index(home) if home in PLUGIN_MODULES else len(PLUGIN_MODULES)
    return (regularizer.passes == PLAN, plugin, list(_REGISTRY).index(regularizer.key))


def registered() -> Tuple[Regularizer, ...]:
    """Every registered regularizer: those of their own passes, then the plan ones (each group the
    plugin's first, in :data:`PLUGIN_MODULES`' order)."""
    _load_plugin_regularizers()
    load_extensions()
    return _ordered()


def planned() -> Tuple[Regularizer, ...]:
    """The registered regularizers that edit the training forward by a plan (:data:`PLAN`): the attn_reg
    task's flags and ``AttnRegTrainer``'s keywords."""
    return tuple(r for r in registered() if r.passes == PLAN)


@functools.cache
def _ordered() -> Tuple[Regularizer, ...]:
    """The registry sorted once per registration: adapters read it at every training step."""
    return tuple(sorted(_REGISTRY.values(), key=_order))


def running(active: Mapping[str, Any]) -> List[Tuple[Regularizer, Any]]:
    """(regularizer, its running object) of an adapter's ``active`` (key -> running object)."""
    return [(by_key(key), runner) for key, runner in active.items()]


def planned_hooks(pairs: List[Tuple[Regularizer, Any]], update: int) -> Dict[Any, Any]:
    """The hooks of one training forward at ``update``: every running regularizer's plan (at most one
    runs: core.combinations refuses two)."""
    return {site: hook for _, runner in pairs for site, hook in runner.hooks(update).items()}


def by_key(key: str) -> Regularizer:
    registered()
    return _REGISTRY[key]


def methods() -> Dict[str, Tuple[Regularizer, Method]]:
    """Every registered regularizer's comparison methods by name: those of the regularizers of their own
    passes in the registry's order, then the plan regularizers' in the order of their names."""
    own = [(m.name, (r, m)) for r in registered() if r.passes == OWN_PASSES for m in r.methods]
    plan = sorted((m.name, (r, m)) for r in registered() if r.passes == PLAN for m in r.methods)
    return dict(own + plan)


_LOADED: List[str] = []


def load_extensions() -> None:
    """Import the files and modules named in ``ATTN_REG_EXTENSIONS`` once each: their :func:`register` calls
    run before anything reads the registry. A name that cannot be imported fails here, naming it."""
    spec = os.environ.get(EXTENSIONS_ENV, "")
    for name in (n.strip() for n in re.split(f"[,{re.escape(os.pathsep)}]", spec)):
        if not name or name in _LOADED:
            continue
        _LOADED.append(name)  # before the import: the file registers by importing this module
        try:
            if name.endswith(".py") or os.sep in name:
                module_spec = importlib.util.spec_from_file_location(
                    f"attn_reg_extension_{len(_LOADED)}", os.path.abspath(name)
                )
                if module_spec is None or not os.path.isfile(name):
                    raise ImportError(f"no such file: {os.path.abspath(name)}")
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
            else:
                importlib.import_module(name)
        except Exception as error:
            _LOADED.remove(name)
            raise ImportError(f"{EXTENSIONS_ENV}: cannot load {name!r}: {error}") from error


# The plugin's own regularizers: each module declares and registers its own, imported on the registry's
# first read (they import this module).
PLUGIN_MODULES = (
    "ad_drop_config",
    "attendout.config",
    "rdrop",
    "hiddencut",
    "scheduled_dropout",
    "layerdrop",
    "drophead",
)


@functools.cache
def _load_plugin_regularizers() -> None:
    for module in PLUGIN_MODULES:
        importlib.import_module(f"{__package__}.{module}")
