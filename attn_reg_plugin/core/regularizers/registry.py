"""A regularizer is one object, registered once; everything that offers regularizers loops over the registry.

A :class:`Regularizer` declares what the adapters and the comparison commands need to know about it:

- its options: a :class:`~.options.RegularizerOptions` dataclass (declared once; fairseq flags, HF
  keywords and the comparison commands' flags all come from it) and the field that turns it on;
- what it does to a training forward: ``build(config, controller)`` returns the running regularizer,
  whose ``hooks(update)`` are the plan of one training forward (the edits of the attention calls it
  selects) and whose ``logged(update)`` are the numbers it logs beside its rate;
- what it logs: its rate is ``counted[0] / counted[1]`` as the kernel counted them where it applied the
  edits (``log_prefix + "_rate"``);
- what it cannot be combined with: every pair is refused unless :mod:`.combinations` lists it;
- its defaults as a method of ``attn-reg-mt-compare`` and ``attn-reg-cls-compare`` (:class:`Method`).

The fairseq task (``--attn-...`` flags, ``train_step``, the metrics), ``AttnRegTrainer`` (its keywords),
both comparison commands' method tables (:func:`method_table`, in :func:`method_names`' one order), the
combination check and the idle-run warning read :func:`registered`; a new regularizer is one file and one :func:`register` call. A file outside the
package is loaded by naming it in ``ATTN_REG_EXTENSIONS`` (paths or module names, separated by ``os.pathsep``
or commas): the plugin imports it before it builds fairseq's task options, in every process that
imports the plugin (fairseq-train, the comparison commands' runs). docs/PORTING.md#your-own-regularizer.

Registered by the plugin: the regularizers that only edit the training forward's attention calls, each
by its own module (:data:`PLUGIN_MODULES`). AD-DROP,
AttendOut, R-Drop and HiddenCut run passes of their own and keep their criteria and trainers.
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
    ``check(config)``: raises ValueError (naming the option) when the config is not this method."""

    name: str
    help: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    mt_defaults: Tuple[Tuple[str, ...], ...] = ()
    required: Tuple[str, ...] = ()
    check: Optional[Callable[[Any], None]] = None


@dataclass(frozen=True)
class Regularizer:
    """One regularizer of the training forward: its options, its plan, its log and its methods.

    ``key``: the HF trainers' keyword (``AttnRegTrainer(layerdrop=AttentionLayerDropConfig(...))``) and the name the
    adapters keep it under. ``name``: as the papers name it, in messages; ``named(config)`` may name a
    variant (DropKey is scheduled dropout's ``dropkey:RATE``). ``switch``: the config field that turns it
    on (a config is on when ``config.enabled``). ``build(config, controller)``: the running regularizer
    (``.config``, ``.sites``, ``.hooks(update)``, ``.logged(update)``). ``counted``: the names of the
    two counts the kernel returns, logged in fairseq as ``log_prefix + "_" + name``; ``counts_calls``:
    they count layer calls (a call made uniform), not units. ``variants``: every name ``named`` may give."""

    key: str
    name: str
    config: type
    switch: str
    build: Callable[[Any, Any], Any]
    log_prefix: str
    counted: Tuple[str, str] = ("dropped", "units")
    counts_calls: bool = False
    methods: Tuple[Method, ...] = ()
    named: Optional[Callable[[Any], str]] = None
    variants: Tuple[str, ...] = ()

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
        """The keys a run's training logs have for it (``*``: a prefix), in HF and fairseq alike."""
        return (self.rate_key(), f"{self.log_prefix}_*")


_REGISTRY: Dict[str, Regularizer] = {}
_FLAG = re.compile(r"[a-z][a-z0-9_]*")


def register(regularizer: Regularizer) -> Regularizer:
    """Add ``regularizer`` to the registry (every adapter and command that loops over regularizers sees
    it). Refused, naming the clash, when its key, a name, a method or a flag prefix is already taken."""
    if not _FLAG.fullmatch(regularizer.key):
        raise ValueError(f"Regularizer.key must be a Python keyword-like name (a-z, 0-9, _), got {regularizer.key!r}")
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


def _order(regularizer: Regularizer) -> Tuple[int, int]:
    """The plugin's in :data:`PLUGIN_MODULES`' order (whichever was imported first), then the others as registered."""
    module = regularizer.config.__module__.rpartition(".")[2]
    plugin = PLUGIN_MODULES.index(module) if regularizer.config.__module__.startswith(__package__ + ".") else None
    return (plugin if plugin is not None else len(PLUGIN_MODULES), list(_REGISTRY).index(regularizer.key))


def registered() -> Tuple[Regularizer, ...]:
    """The registered regularizers, in the order they were registered (the plugin's first)."""
    _load_plugin_regularizers()
    load_extensions()
    return _ordered()


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
    """Every registered regularizer's comparison methods by name, in the order of their names."""
    return dict(sorted((m.name, (r, m)) for r in registered() for m in r.methods))


# The comparison commands' methods, in the one order both commands list them: plain, the regularizers
# that run passes of their own (AD-DROP, AttendOut, R-Drop, HiddenCut: each command binds such a name to
# how its framework trains it, a fairseq criterion or a Trainer), every registered regularizer's methods
# by name, then the one combination the plugin allows (R-Drop over AD-DROP's masked pass).
OWN_PASS_METHODS = ("ad-drop", "attendout", "r-drop", "hiddencut")
COMBINED_METHODS = ("ad-drop-r-drop",)


def method_names() -> Tuple[str, ...]:
    """Every comparison method's name, in the commands' order."""
    return ("plain", *OWN_PASS_METHODS, *methods(), *COMBINED_METHODS)


def method_table(bound: Mapping[str, Any], from_registry: Callable[[Regularizer, Method], Any]) -> Dict[str, Any]:
    """A command's method table in :func:`method_names`' order: ``bound`` gives the command's own
    entries for plain, the own-pass methods and the combination (all of them, nothing else);
    ``from_registry(regularizer, method)`` makes a registry method's."""
    own = {"plain", *OWN_PASS_METHODS, *COMBINED_METHODS}
    if set(bound) != own:
        raise ValueError(f"a method table binds exactly {sorted(own)}, got {sorted(bound)}")
    registry = methods()
    return {name: bound[name] if name in own else from_registry(*registry[name]) for name in method_names()}


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
PLUGIN_MODULES = ("scheduled_dropout", "layerdrop", "drophead")


@functools.cache
def _load_plugin_regularizers() -> None:
    for module in PLUGIN_MODULES:
        importlib.import_module(f"{__package__}.{module}")
