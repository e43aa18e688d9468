"""fairseq parts of attn_reg_plugin, one file per registered name (as fairseq's own user-dir examples).

Tasks: ``attn_reg_translation``, ``attn_reg_sentence_prediction`` (shared part: ``attn_reg_task``).
Criterions: ``ad_drop_label_smoothed_cross_entropy``, ``ad_drop_sentence_prediction`` (shared
part: ``ad_drop_criterion``), ``rdrop_label_smoothed_cross_entropy`` (R-Drop),
``ad_drop_rdrop_label_smoothed_cross_entropy`` (R-Drop over AD-DROP's masked pass) and
``hiddencut_label_smoothed_cross_entropy`` (HiddenCut). Also the
attention module (``attention``), AttendOut's Attacker driver (``attendout``), the option
dataclasses generated from the core configs (``options``), safe checkpoint loading
(``safe_load``), the save on a Slurm job's time-limit signal (``attn_reg_plugin.time_limit``) and the filters of fairseq's known-harmless warnings (``known_warnings``).
"""

from .. import time_limit  # noqa: E402
from . import (  # noqa: F401  (registration side effects)
    ad_drop_label_smoothed_cross_entropy,
    ad_drop_rdrop_label_smoothed_cross_entropy,
    ad_drop_sentence_prediction,
    attention,
    attn_reg_sentence_prediction,
    attn_reg_translation,
    hiddencut_label_smoothed_cross_entropy,
    known_warnings,  # noqa: F401  (silences fairseq's known-harmless start-up warnings)
    rdrop_label_smoothed_cross_entropy,
    safe_load,  # noqa: F401  (allow-lists fairseq's pickled checkpoint globals)
)

time_limit.install()  # a Slurm job's fairseq-train: saves and exits on the time-limit signal
