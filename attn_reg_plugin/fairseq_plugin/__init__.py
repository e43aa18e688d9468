"""fairseq parts of attn_reg_plugin: tasks, criterions, attention module, safe loading."""
from . import safe_load  # noqa: F401  (allow-lists fairseq's pickled checkpoint globals)
from . import attention, criterions, tasks  # noqa: F401  (registration side effects)
