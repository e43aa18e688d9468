"""Graph breaks of a training step compiled whole (``attn-reg-gpu-cost --compile``).

``torch.compile`` of one benchmark step (its ``compute_loss``, backward and optimizer step), after
one eager step, with a backend that only counts: how many graphs dynamo makes of it, and its graph breaks by reason. Plain
training's step is counted beside the regularized one, so that the breaks the plugin adds show.
A break is a return to Python between graphs: on a GPU, launches that no compiler fuses and, for a
host read, a wait.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict


def graph_breaks(step) -> Dict[str, object]:
    """{graphs, breaks, dynamo_breaks, reasons} of ``step`` (a benchmark
    :class:`~.benchmark.variants.Step`) compiled whole. ``breaks`` is graphs - 1: each break that
    splits the step starts a graph. ``reasons``: dynamo's count of each reason it broke or skipped for
    (its first line), ``dynamo_breaks`` their sum; some end no graph (a skipped ``torch.compiler.disable``
    function, a reason met again when a frame is retried)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with step.state():
        # One eager step first, as a training loop has run before it is timed: what a step keeps for the
        # next (AD-DROP's probes, an optimizer's state) is there.
        step.prepare(0)
        step.run()
        step.prepare(1)
        torch.compile(step.run, backend=counting_backend)()
    reasons = Counter()
    for reason, n in counters["graph_break"].items():
        reasons[reason.strip().splitlines()[0][:120]] += n
    torch._dynamo.reset()
    return {
        "graphs": len(graphs),
        "breaks": max(0, len(graphs) - 1),
        "dynamo_breaks": sum(reasons.values()),
        "reasons": dict(reasons.most_common()),
    }
