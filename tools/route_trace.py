#!/usr/bin/env python
"""Which plugin files one regularized attention call runs code in, in order, measured.

design.md draws the route of a call by hand (issue 41 asks at most 4 plugin files for a short call
and 6 for a long one, no file visited twice). This traces it instead: ``sys.setprofile`` records
every Python frame entered between a call's entry (``attn_reg_attention`` for transformers,
``attend`` for a custom model) and its return, and keeps the plugin files they belong to, a file
listed again each time control comes back to it. Helpers count (a mask utility is a file the reader
must open too); torch and transformers do not. It also lists which file calls which (the nearest
plugin frame below each call) and the files that call back into one that called them, directly or
through others: a return to the caller is not a call back.

    .venv/bin/python tools/route_trace.py            # AD-DROP pass 2 (GA and RD) on a tiny BERT

One pass-2 call of each: a short map (one block, 16 tokens) and a long one (700 tokens, block by block).
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

import attn_reg_plugin
from attn_reg_plugin.core import ADDrop, ADDropConfig, RegularizationController, logit_target
from attn_reg_plugin.hf import install_attention_sites

ROOT = os.path.dirname(attn_reg_plugin.__file__)


def plugin_file(frame):
    name = frame.f_code.co_filename if frame is not None else ""
    return os.path.relpath(name, ROOT) if name.startswith(ROOT) else None


def caller_file(frame):
    """The plugin file of the nearest plugin frame that called ``frame`` (through torch or not)."""
    frame = frame.f_back
    while frame is not None and plugin_file(frame) is None:
        frame = frame.f_back
    return plugin_file(frame)


def route(run, entry: str, calls=None):
    """The plugin files of the first call of function ``entry`` during ``run()``, one per visit;
    ``calls``, a set, gets each (calling file, called file) pair of different files."""
    visits, depth, done = [], [0], [False]

    def note(path):
        if path is not None and (not visits or visits[-1] != path):
            visits.append(path)

    def profile(frame, event, arg):
        if done[0] or event not in ("call", "return"):
            return
        if event == "call":
            if depth[0] or frame.f_code.co_name == entry:
                depth[0] += 1
                callee = plugin_file(frame)
                note(callee)
                if calls is not None and callee and depth[0] > 1:  # the entry's caller is not on the route
                    caller = caller_file(frame)
                    if caller and caller != callee:
                        calls.add((caller, callee))
            return
        if depth[0]:
            depth[0] -= 1
            done[0] = depth[0] == 0
            if not done[0]:
                note(plugin_file(frame.f_back))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return visits


def called_back(calls) -> list:
    """The files of ``calls`` (pairs) on a cycle: each reaches itself again through the files it calls."""
    callees = {}
    for caller, callee in calls:
        callees.setdefault(caller, set()).add(callee)

    def reaches(start, target, seen):
        for nxt in callees.get(start, ()):
            if nxt == target:
                return True
            if nxt not in seen:
                seen.add(nxt)
                if reaches(nxt, target, seen):
                    return True
        return False

    return sorted(f for f in callees if reaches(f, f, set()))


def masked_call_route(tokens: int, attribution: str, calls=None):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=50,
        max_position_embeddings=1024, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    controller = RegularizationController()
    install_attention_sites(model, controller)
    ad_drop = ADDrop(ADDropConfig(p=0.3, q=0.5, attribution=attribution, schedule="always"), controller)
    ids = torch.randint(3, 50, (2, tokens))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0

    def forward():
        return model(input_ids=ids, attention_mask=mask)

    with ad_drop.masked(forward, lambda out, labels: logit_target(out.logits, None), frozen=model):
        return route(forward, "attn_reg_attention", calls)


def main() -> int:
    for tokens, length in ((16, "short"), (700, "long")):
        for attribution in ("ga", "rd"):
            calls = set()
            visits = masked_call_route(tokens, attribution, calls)
            again = sorted({f for f in visits if visits.count(f) > 1})
            print(f"HF, {length} call ({tokens} tokens), AD-DROP {attribution.upper()} pass 2: {len(set(visits))} files, "
                  f"{len(visits)} visits, visited again: {', '.join(again) or 'none'}")  # fmt: skip
            print("    " + " -> ".join(visits[:40]) + (" -> ..." if len(visits) > 40 else ""))
            print("    calls: " + ", ".join(f"{a} -> {b}" for a, b in sorted(calls)))
            print("    called back: " + (", ".join(called_back(calls)) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
