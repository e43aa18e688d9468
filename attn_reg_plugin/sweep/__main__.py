"""``python -m attn_reg_plugin.sweep``: the ``attn-reg-mt-sweep`` command."""

import sys

from . import main

sys.exit(main())
