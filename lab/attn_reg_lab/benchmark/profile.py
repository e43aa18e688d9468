"""Profile: where a variant's extra time goes (torch.profiler record_function labels)."""

from __future__ import annotations

from typing import Sequence

from .variants import VARIANTS, WORKLOAD_ORDER

PROFILE_LABELS = {  # record_function labels set by the core and by fairseq's train_step
    "ad_drop::attribution_pass": "attribution pass",
    "ad_drop::attribution_gradient": "  of which autograd.grad",
    "ad_drop::masks": "masks",
}


def profile_variants(framework: str, bench, names: Sequence[str], log) -> str:
    """One profiled step of plain and of each variant (after one warm-up step each).

    Reports each step's profiled CPU time (sum of op self times) as a fraction of plain's,
    the core's labelled parts, the optimizer step, and the ops whose self time grew most.
    """
    from torch.profiler import ProfilerActivity, profile

    chosen = [v for v in VARIANTS if v.name in names and framework in v.builders]
    lines = []
    for workload in WORKLOAD_ORDER:
        variants = [v for v in chosen if v.workload == workload]
        if not variants:
            continue
        steps = {"plain": bench.reference(workload)}
        steps.update({v.name: v.builders[framework](bench, workload) for v in variants})
        tables = {}
        for n, step in steps.items():
            with step.state():
                step.prepare(0)
                step.run()  # warm-up
                step.prepare(1)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step.run()
            ka = prof.key_averages()
            tables[n] = {e.key: (e.self_cpu_time_total / 1e3, e.cpu_time_total / 1e3, e.count) for e in ka}
            log(f"  profiled {framework}/{workload} {n}")
        plain_total = sum(v[0] for v in tables["plain"].values())
        lines.append(f"### {framework} / {workload}: {bench.batch_descriptions[workload]}")
        lines.append("")
        lines.append(
            "| step | profiled CPU ms | × plain | " + " | ".join(PROFILE_LABELS.values()) + " | optimizer step |"
        )
        lines.append("|---" * (4 + len(PROFILE_LABELS)) + "|")
        for n, table in tables.items():
            total = sum(v[0] for v in table.values())
            parts = [f"{table[k][1] / plain_total:.3f}" if k in table else "-" for k in PROFILE_LABELS]
            optimizer = sum(v[1] for k, v in table.items() if k.startswith("Optimizer.step#"))
            lines.append(
                f"| {n} | {total:.0f} | {total / plain_total:.3f} | "
                + " | ".join(parts)
                + f" | {optimizer / plain_total:.3f} |"
            )
        lines.append("")
        lines.append("Parts are fractions of the plain step's profiled CPU time.")
        for n in steps:
            if n == "plain":
                continue
            grown = sorted(
                (
                    (tables[n].get(k, (0, 0, 0))[0] - tables["plain"].get(k, (0, 0, 0))[0], k)
                    for k in set(tables[n]) | set(tables["plain"])
                ),
                reverse=True,
            )[:12]
            lines.append("")
            lines.append(f"{n}: ops whose self time grew most against plain (fraction of plain; calls plain -> {n})")
            lines.append("")
            for delta, k in grown:
                calls = (tables["plain"].get(k, (0, 0, 0))[2], tables[n].get(k, (0, 0, 0))[2])
                lines.append(f"    {k[:70]:70s} {delta / plain_total:+.3f}  ({calls[0]} -> {calls[1]})")
        lines.append("")
    return "\n".join(lines)
