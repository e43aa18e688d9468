"""What fairseq imports for ``--user-dir "$(attn-reg-user-dir)"``: the plugin's fairseq parts.

fairseq imports a user dir as a top-level module named after the folder, once per path. This
module is imported only that way, so the registration below runs whether or not
``attn_reg_plugin`` was imported before (``--user-dir PATH/attn_reg_plugin`` registers nothing
when the package is already loaded: fairseq then only logs that it was imported).
"""

import attn_reg_plugin.fairseq_plugin  # noqa: F401  (registers the tasks, criterions and options)
