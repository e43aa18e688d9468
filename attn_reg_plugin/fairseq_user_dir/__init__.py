"""Holds the folder fairseq's ``--user-dir`` points at (see :mod:`attn_reg_plugin.user_dir`)."""
