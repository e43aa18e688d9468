"""Experiments around the plugin: the demo, the benchmark, the few-shot runner, the corpus builder, plots.

Package code with console commands (``attn-reg-demo``, ``attn-reg-benchmark``, ...; see
pyproject.toml), never imported by the plugin itself, so ``--user-dir attn_reg_plugin`` stays
cheap. The shipped data they default to live in the checkout (:mod:`.paths`).
"""
