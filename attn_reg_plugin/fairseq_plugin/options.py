"""fairseq option dataclasses generated from the core configs (each option is declared once, there).

``fairseq_options("ADDropOptions", [ADDropConfig])`` is a ``FairseqDataclass``
with one field ``ad_drop_<name>`` per ``ADDropConfig`` field: same type, default and help, so
``--ad-drop-p`` and ``ADDropConfig.p`` cannot drift apart. Options that exist only in fairseq
(``--attendout`` itself, the Attacker's clip norm, …) are passed as ``extra`` fields.
"""

import dataclasses
from typing import Iterable, Sequence, Tuple

from fairseq.dataclass import FairseqDataclass

from ..core.regularizers.options import attribute_prefix, options_of


def fairseq_options(
    class_name: str, configs: Sequence[type], extra: Iterable[Tuple[str, type, dataclasses.Field]] = ()
) -> type:
    """A FairseqDataclass whose fields are ``<attribute prefix><field>`` of each config class
    (``ad_drop_p`` for ``ADDropConfig.p``), after the ``extra`` ``(name, type, field)`` entries."""
    fields = list(extra)
    for config_cls in configs:
        prefix = attribute_prefix(config_cls)
        for opt in options_of(config_cls):
            fields.append(
                (prefix + opt.name, opt.type, dataclasses.field(default=opt.default, metadata={"help": opt.help}))
            )
    return dataclasses.make_dataclass(class_name, fields, bases=(FairseqDataclass,), namespace={"__module__": __name__})
