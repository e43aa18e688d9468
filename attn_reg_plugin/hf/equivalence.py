"""The install-time check that routing a model's attention through the plugin changes nothing:
its own implementation against transformers' sdpa (the idle path), the kernel with a hook that
edits nothing against the idle path, and for decoder-only models a left-padded row."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .probe_inputs import LEFT_PADDING, accepted_inputs, eval_mode, left_padded, probe_candidates


def float_tensors(output) -> List[torch.Tensor]:
    """The floating tensors of a model output, in order (caches and integer tensors left out)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in float_tensors(item)]
    return []


def tolerance(dtype: torch.dtype) -> float:
    # Relative to max(1, |reference|): sdpa and eager round differently; a missing term does not hide in it.
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


def run_recorded(
    module, inputs, attention_modules
) -> Tuple[List[torch.Tensor], List[Tuple[torch.nn.Module, torch.Tensor]]]:
    """The module's floating outputs and each attention module's output, per call in forward order."""
    per_call: List[Tuple[torch.nn.Module, torch.Tensor]] = []

    def record(mod, _args, out):
        tensors = float_tensors(out)
        per_call.append((mod, tensors[0].detach().clone() if tensors else None))

    handles = [m.register_forward_hook(record) for m in attention_modules]
    try:
        with torch.no_grad():
            outputs = [t.detach().clone() for t in float_tensors(module(**inputs))]
    finally:
        for h in handles:
            h.remove()
    return outputs, per_call


def keyless_part(t: torch.Tensor, length: int) -> torch.Tensor:
    """The left-padded probe row's padding positions of a (batch, position, ...) tensor (:func:`left_padded`)."""
    return t[1, :LEFT_PADDING] if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == length else t[:0]


def first_difference(reference, candidate, paths, keyless_of: int = 0) -> Optional[Tuple[str, float, float]]:
    """(where, |difference|, tolerance) of the first attention call, else output, that differs.

    ``keyless_of``: compare only the padding positions of the left-padded row of a probe that long,
    at float32's tolerance whatever the dtype. Those positions see no other, so two implementations
    that both give their keyless rows 0 agree there up to float32 rounding even in half precision,
    while giving them anything else shows however small the model's values are.
    """

    def difference(a, b) -> Tuple[float, float]:  # (max |a - b|, tolerance), relative to max(1, |a|)
        if keyless_of:
            a, b = keyless_part(a, keyless_of), keyless_part(b, keyless_of)
            if a.numel() == 0:
                return 0.0, 0.0
        tol = tolerance(torch.float32 if keyless_of else a.dtype) * max(1.0, float(a.float().abs().max()))
        return (float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")), tol

    (ref_out, ref_calls), (out, calls) = reference, candidate
    pairs = [
        (paths.get(id(mod), type(mod).__name__), a, b)
        for (mod, a), (_, b) in zip(ref_calls, calls)
        if a is not None and b is not None
    ]
    for where, a, b in pairs + [("the model's output", a, b) for a, b in zip(ref_out, out)]:
        diff, tol = difference(a, b)
        if not diff <= tol:
            return where, diff, tol
    return None


class EquivalenceCheck:
    """Refuse a model whose outputs change when its attention runs through the plugin; each check
    raises ``ValueError`` naming the model, the first call that differs and why it matters."""

    def __init__(self, model, probed, inputs, attention_modules, paths, configs, before, implementation):
        self.model, self.probed, self.inputs = model, probed, inputs
        self.attention_modules, self.paths = attention_modules, paths
        self.configs, self.before, self.implementation = configs, before, implementation
        self.name = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"
        # The model's own implementations: empty when installed before (the Attacker is a copy).
        self.own = set(before.values()) - {implementation}

    def refuse_if_different(self, reference, candidate, what: str, why: str, probe="probe input", **how) -> None:
        found = first_difference(reference, candidate, self.paths, **how)
        if found is not None:
            where, diff, tol = found
            raise ValueError(
                f"{self.name}: {what} (max |difference| {diff:.3g} > {tol:.3g} at {where}, {probe}, eval mode): {why}"
            )

    def run_own(self, module, given):
        """``module`` run under the model's own attention implementation(s)."""
        for key, config in self.configs.items():
            config._attn_implementation = self.before[key]
        try:
            return run_recorded(module, given, self.attention_modules)
        finally:
            for config in self.configs.values():
                config._attn_implementation = self.implementation

    def own_against_sdpa(self, idle) -> None:
        if self.own:
            self.refuse_if_different(
                self.run_own(self.probed, self.inputs),
                idle,
                "routing attention through attn_reg_plugin changes this model's forward",
                f"its attention implementation {sorted(self.own)} computes something transformers' sdpa does "
                "not. Refused, to leave no forward silently changed; the README lists the supported families",
            )

    def keyless_rows(self) -> None:
        """A decoder-only model whose own attention is not sdpa, on a left-padded row."""
        padded = left_padded(self.model, self.inputs) if self.own - {"sdpa"} else None
        if padded is None:
            return
        module, stock = run_padded(self.model, self.probed, padded, self.run_own)
        self.refuse_if_different(
            stock,
            run_recorded(module, accepted_inputs(module, padded), self.attention_modules),
            "routing attention through attn_reg_plugin changes this model's forward on left-padded input",
            f"its attention implementation {sorted(self.own - {'sdpa'})} does not give 0 for a query row with no "
            "valid key (a left-padding position: its logits predict the first real token; eager spreads the "
            "row uniformly over all keys, masked and future ones included), while the plugin, like "
            "transformers' sdpa, gives it 0. Refused, to leave no loss or gradient silently changed; for "
            'exact equivalence switch the model to sdpa first: from_pretrained(..., attn_implementation="sdpa") '
            'or model.set_attn_implementation("sdpa")',
            probe="the left-padded row's padding positions",
            keyless_of=padded["input_ids"].shape[1],
        )

    def kernel_against_idle(self, controller, idle) -> None:
        from ..core.kernel.attention_call import EditScores

        try:
            with controller.hooks({site: EditScores() for site in controller.sites}):
                active = run_recorded(self.probed, self.inputs, self.attention_modules)
        except NotImplementedError as err:
            raise ValueError(f"{self.name}: the regularized attention cannot run this model: {err}") from None
        self.refuse_if_different(
            idle,
            active,
            "attn_reg_plugin's regularized kernel does not reproduce this model's attention with nothing dropped",
            "refused: every regularized step would change more than the regularizer",
        )


def check_equivalent(
    model, controller, probed, inputs, attention_modules, paths, configs, before, implementation, causal_lm=False
) -> None:
    """The idle path (transformers' sdpa) against the model's own implementation, and the kernel path
    with a hook that edits nothing against the idle path, both on the probe input; a decoder-only
    (``causal_lm``) model whose own implementation is not sdpa also on a batch with a left-padded
    row, whose padding queries have no valid key (:func:`.probe_inputs.left_padded`)."""
    check = EquivalenceCheck(model, probed, inputs, attention_modules, paths, configs, before, implementation)
    with eval_mode(model):
        idle = run_recorded(probed, inputs, attention_modules)
        check.own_against_sdpa(idle)
        if causal_lm:
            check.keyless_rows()
        check.kernel_against_idle(controller, idle)


def run_padded(model, probed, padded, run_own):
    """(the module run, its outputs) for the left-padded probe under the model's own attention: the
    probed module, else its backbone (a classification head without a pad token rejects a batch of two)."""
    failures = []
    candidates = [probed] + [m for m in probe_candidates(model) if m is not probed and m is not model]
    for module in candidates:
        try:
            return module, run_own(module, accepted_inputs(module, padded))
        except Exception as err:
            failures.append(f"{type(module).__name__}: {type(err).__name__}: {err}")
    raise ValueError(
        f"{type(model).__name__}: the left-padded probe forward that checks rows with no valid key failed "
        f"({'; '.join(failures)})"
    )
