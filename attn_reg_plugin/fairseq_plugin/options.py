"""fairseq option dataclasses generated from the core configs (each option is declared once, there).

``fairseq_options("ADDropOptions", [(ADDropConfig, "ad_drop_")])`` is a ``FairseqDataclass``
with one field ``ad_drop_<name>`` per ``ADDropConfig`` field: same type, default and help, so
``--ad-drop-p`` and ``ADDropConfig.p`` cannot drift apart. Options that exist only in fairseq
(``--attendout`` itself, the Attacker's clip norm, …) are passed as ``extra`` fields.
"""
import dataclasses
from typing import Iterable, Sequence, Tuple

from fairseq.dataclass import FairseqDataclass

from ..core.options import options_of


def fairseq_options(class_name: str, configs: Sequence[Tuple[type, str]],
                    extra: Iterable[Tuple[str, type, dataclasses.Field]] = ()) -> type:
    """A FairseqDataclass whose fields are ``prefix + field`` of each ``(config class, prefix)``,
    after the ``extra`` ``(name, type, field)`` entries."""
    fields = list(extra)
    for config_cls, prefix in configs:
        for opt in options_of(config_cls):
            fields.append((prefix + opt.name, opt.type, dataclasses.field(default=opt.default, metadata={"help": opt.help})))
    return dataclasses.make_dataclass(class_name, fields, bases=(FairseqDataclass,), namespace={"__module__": __name__})
