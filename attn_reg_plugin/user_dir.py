"""``attn-reg-user-dir`` (or ``python -m attn_reg_plugin.user_dir``): print the folder to give
fairseq's ``--user-dir``, wherever the package is installed.

    fairseq-train DATA_BIN --user-dir "$(attn-reg-user-dir)" --task attn_reg_translation ...

It works in every import order: the folder holds one tiny module that imports
:mod:`attn_reg_plugin.fairseq_plugin`, which registers the plugin's fairseq parts.
"""

import os

FAIRSEQ_USER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_user_dir", "attn_reg_fairseq")


def main() -> None:
    print(FAIRSEQ_USER_DIR)


if __name__ == "__main__":
    main()
