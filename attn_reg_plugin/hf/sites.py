"""Which transformers module gets which attention site: found by watching the calls, not by names.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[...](module, query, key, ...)``,
so the attention function sees every module that attends, whatever its class or attribute
names (BERT's ``query``, GPT-2's fused ``c_attn``, ModernBERT's ``Wqkv``, T5's ``q``).
:func:`route_attention_calls` runs one probe forward on a short input (encoder and decoder
inputs of different lengths) with the recorder on, and gives each call a site:

* kind: a call whose keys are as long as the encoder input while its queries are as long as the
  decoder input is encoder-decoder attention; otherwise causal calls (and calls on the decoder
  input) are decoder-self, the rest encoder-self;
* layer: the call's rank among the calls of its kind, in forward order (the depth).

A module called at several depths in one forward (ALBERT shares one layer across the stack)
gets one site per depth; its calls are counted from the start of each forward of the model.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..core.checkpointing import recomputing
from ..core.controller import AttentionSite, RegularizationController

logger = logging.getLogger(__name__)

# Encoder and decoder probe lengths: different, so a call's key length tells where its keys come from.
_ENCODER_LEN, _DECODER_LEN = 7, 4
# Padding tokens in front of the left-padded probe row (decoder-only models, own attention not sdpa).
_LEFT_PADDING = 3

_recorded: Optional[List[Tuple[torch.nn.Module, bool, int, int]]] = None  # set during the probe


def site_of_call(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, is_causal: Optional[bool]
) -> Optional[AttentionSite]:
    """The site of this call of ``module`` (None: not regularized); records calls during the probe."""
    if _recorded is not None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        _recorded.append((module, causal, query.shape[2], key.shape[2]))
        return None
    sites = getattr(module, "attn_reg_sites", None)
    if not sites:
        return None
    if len(sites) == 1:
        return sites[0]
    if recomputing():
        raise NotImplementedError(
            f"{type(module).__name__} is one attention module called at {len(sites)} depths (shared layers); "
            "activation checkpointing cannot tell which depth it recomputes. Train it without gradient checkpointing"
        )
    depth = module.attn_reg_calls
    module.attn_reg_calls = depth + 1
    return sites[depth % len(sites)]


def _probe_inputs(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    config = model.config
    device = next(model.parameters()).device
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    special = {
        getattr(config, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
    }
    tokens = [t for t in range(vocab) if t not in special][:_ENCODER_LEN]
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_features":  # speech encoders (Whisper): log-mel frames, length fixed by the config
        frames = 2 * int(config.max_source_positions)
        inputs = {main: torch.zeros(1, int(config.num_mel_bins), frames, device=device)}
    else:
        if len(tokens) < _ENCODER_LEN:
            raise ValueError(f"{type(model).__name__}: cannot build a probe input from a vocabulary of {vocab} tokens")
        ids = torch.tensor([tokens], device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None)
        start = tokens[0] if start is None else start
        inputs["decoder_input_ids"] = torch.tensor([[start] + tokens[1:_DECODER_LEN]], device=device)
    return inputs


def _left_padded(model: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
    """The probe input plus a left-padded copy of its row (None: the input has no padding mask).

    In causal attention a left-padding query sees only padding keys: a query row with no valid
    key. Its output is the logits at the last padding position, which predict the first real token.
    """
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None or mask is None or ids.shape[0] != 1 or ids.shape[1] <= _LEFT_PADDING:
        return None
    pad, vocab = getattr(model.config, "pad_token_id", None), int(getattr(model.config, "vocab_size", 0) or 0)
    if not (isinstance(pad, int) and 0 <= pad < vocab):  # no pad token (GPT-2): any token, it is masked
        pad = int(ids[0, 0])
    row = torch.cat([ids.new_full((1, _LEFT_PADDING), pad), ids[:, : ids.shape[1] - _LEFT_PADDING]], dim=1)
    row_mask = torch.cat([mask.new_zeros(1, _LEFT_PADDING), mask[:, : mask.shape[1] - _LEFT_PADDING]], dim=1)
    return {**inputs, "input_ids": torch.cat([ids, row]), "attention_mask": torch.cat([mask, row_mask])}


@contextlib.contextmanager
def _recording() -> Iterator[List[Tuple[torch.nn.Module, bool, int, int]]]:
    global _recorded
    _recorded = []
    try:
        yield _recorded
    finally:
        _recorded = None


def _accepted(module: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The probe inputs ``module.forward`` takes (a backbone may take fewer than its head model)."""
    params = inspect.signature(module.forward).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return inputs
    return {k: v for k, v in inputs.items() if k in params}


def _probe_candidates(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model, then the backbone its head wraps: every attention module is in the backbone,
    and some heads reject a one-sequence probe (multiple choice wants (B, choices, T); an
    encoder-decoder classifier wants decoder inputs as long as its encoder inputs)."""
    base = getattr(model, "base_model", None)
    return [model] + ([base] if isinstance(base, torch.nn.Module) and base is not model else [])


def _probe(
    model: torch.nn.Module,
) -> Tuple[torch.nn.Module, Dict[str, torch.Tensor], List[Tuple[torch.nn.Module, bool, int, int]]]:
    """(the module probed, its inputs, the attention calls it made)."""
    inputs = _probe_inputs(model)
    failures = []
    for module in _probe_candidates(model):
        given = _accepted(module, inputs)
        try:
            with _recording() as calls, _eval_mode(model), torch.no_grad():
                module(**given)
            return module, given, calls
        except Exception as err:  # a head that cannot take the probe input: try its backbone
            failures.append(f"{type(module).__name__}: {type(err).__name__}: {err}")
    raise ValueError(
        f"{type(model).__name__}: the probe forward that finds the attention modules failed ({'; '.join(failures)})"
    )


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _kind(model: torch.nn.Module, causal: bool, q_len: int, kv_len: int, encoder_len: int) -> str:
    if getattr(model.config, "is_encoder_decoder", False):
        if q_len == _DECODER_LEN and kv_len == encoder_len != _DECODER_LEN:
            return "encoder-decoder"
        return "decoder-self" if causal or q_len == _DECODER_LEN else "encoder-self"
    return "decoder-self" if causal else "encoder-self"


def _reset_call_counts(modules):
    def reset(*_args, **_kwargs):
        for module in modules:
            module.attn_reg_calls = 0

    return reset


def installed_sites(model: torch.nn.Module) -> List[Tuple[str, AttentionSite]]:
    """The ``(module path, site)`` pairs the model's modules hold now, as :func:`route_attention_calls` returned them."""
    return [
        (path, site) for path, module in model.named_modules() for site in module.__dict__.get("attn_reg_sites", [])
    ]


def site_claim(model: torch.nn.Module, pairs: List[Tuple[str, AttentionSite]]) -> Callable[[], None]:
    """A function that gives the modules named in ``pairs`` (from an install on this model) those
    sites again, in order. Modules hold one set of sites at a time and every install replaces them,
    so whoever regularizes a model that another install has touched since (a second trainer on
    the same model) claims its own sites before its regularized forward. A claim is one attribute
    per attention module: cheap enough for every training step."""
    modules = dict(model.named_modules())
    grouped: Dict[str, List[AttentionSite]] = {}
    for path, site in pairs:
        grouped.setdefault(path, []).append(site)
    owned = [(modules[path], sites) for path, sites in grouped.items()]

    def claim() -> None:
        for module, sites in owned:
            if module.__dict__.get("attn_reg_sites") is not sites:
                module.attn_reg_sites = sites

    return claim


def assign_sites(model: torch.nn.Module, pairs: List[Tuple[str, AttentionSite]]) -> None:
    """Give the modules named in ``pairs`` (from an install on this model) those sites, in order."""
    site_claim(model, pairs)()


@contextlib.contextmanager
def sites_in_use(model: torch.nn.Module, pairs: List[Tuple[str, AttentionSite]]) -> Iterator[None]:
    """:func:`assign_sites` for a while: several controllers can share one model, each in turn."""
    before = installed_sites(model)
    assign_sites(model, pairs)
    try:
        yield
    finally:
        assign_sites(model, before)


def _floats(output) -> List[torch.Tensor]:
    """The floating tensors of a model output, in order (caches and integer tensors left out)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _floats(item)]
    return []


def _tolerance(dtype: torch.dtype) -> float:
    # Relative to max(1, |reference|): sdpa and eager round differently; a missing term does not hide in it.
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


def _run_recorded(
    module, inputs, attention_modules
) -> Tuple[List[torch.Tensor], List[Tuple[torch.nn.Module, torch.Tensor]]]:
    """The module's floating outputs and each attention module's output, per call in forward order."""
    per_call: List[Tuple[torch.nn.Module, torch.Tensor]] = []

    def record(mod, _args, out):
        tensors = _floats(out)
        per_call.append((mod, tensors[0].detach().clone() if tensors else None))

    handles = [m.register_forward_hook(record) for m in attention_modules]
    try:
        with torch.no_grad():
            outputs = [t.detach().clone() for t in _floats(module(**inputs))]
    finally:
        for h in handles:
            h.remove()
    return outputs, per_call


def _keyless_part(t: torch.Tensor, length: int) -> torch.Tensor:
    """The left-padded probe row's padding positions of a (batch, position, ...) tensor (:func:`_left_padded`)."""
    return t[1, :_LEFT_PADDING] if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == length else t[:0]


def _first_difference(reference, candidate, paths, keyless_of: int = 0) -> Optional[Tuple[str, float, float]]:
    """(where, |difference|, tolerance) of the first attention call, else output, that differs.

    ``keyless_of``: compare only the padding positions of the left-padded row of a probe that long,
    at float32's tolerance whatever the dtype. Those positions see no other, so two implementations
    that both give their keyless rows 0 agree there up to float32 rounding even in half precision,
    while giving them anything else shows however small the model's values are.
    """

    def difference(a, b) -> Tuple[float, float]:  # (max |a - b|, tolerance), relative to max(1, |a|)
        if keyless_of:
            a, b = _keyless_part(a, keyless_of), _keyless_part(b, keyless_of)
            if a.numel() == 0:
                return 0.0, 0.0
        tol = _tolerance(torch.float32 if keyless_of else a.dtype) * max(1.0, float(a.float().abs().max()))
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


def _check_equivalent(
    model, controller, probed, inputs, attention_modules, paths, configs, before, implementation, causal_lm=False
) -> None:
    """Refuse a model whose outputs change when its attention runs through the plugin: the idle
    path (transformers' sdpa) against the model's own implementation, and the kernel path with a
    hook that edits nothing against the idle path. Both on the probe input; a decoder-only
    (``causal_lm``) model whose own implementation is not sdpa is also compared on a batch with a
    left-padded row, whose padding queries have no valid key (:func:`_left_padded`)."""
    from ..core.attention import EditScores

    name = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"

    def refuse_if_different(reference, candidate, what: str, why: str, probe: str = "probe input", **how) -> None:
        found = _first_difference(reference, candidate, paths, **how)
        if found is not None:
            where, diff, tol = found
            raise ValueError(
                f"{name}: {what} (max |difference| {diff:.3g} > {tol:.3g} at {where}, {probe}, eval mode): {why}"
            )

    def run_own(module, given):
        for key, config in configs.items():
            config._attn_implementation = before[key]
        try:
            return _run_recorded(module, given, attention_modules)
        finally:
            for config in configs.values():
                config._attn_implementation = implementation

    with _eval_mode(model):
        idle = _run_recorded(probed, inputs, attention_modules)
        own = set(before.values()) - {implementation}  # empty: installed before (the Attacker is a copy)
        if own:
            refuse_if_different(
                run_own(probed, inputs),
                idle,
                "routing attention through attn_reg_plugin changes this model's forward",
                f"its attention implementation {sorted(own)} computes something transformers' sdpa does "
                "not. Refused, to leave no forward silently changed; the README lists the supported families",
            )
        padded = _left_padded(model, inputs) if causal_lm and own - {"sdpa"} else None
        if padded is not None:
            module, stock = _run_padded(model, probed, padded, run_own)
            refuse_if_different(
                stock,
                _run_recorded(module, _accepted(module, padded), attention_modules),
                "routing attention through attn_reg_plugin changes this model's forward on left-padded input",
                f"its attention implementation {sorted(own - {'sdpa'})} does not give 0 for a query row with no "
                "valid key (a left-padding position: its logits predict the first real token; eager spreads the "
                "row uniformly over all keys, masked and future ones included), while the plugin, like "
                "transformers' sdpa, gives it 0. Refused, to leave no loss or gradient silently changed; for "
                'exact equivalence switch the model to sdpa first: from_pretrained(..., attn_implementation="sdpa") '
                'or model.set_attn_implementation("sdpa")',
                probe="the left-padded row's padding positions",
                keyless_of=padded["input_ids"].shape[1],
            )
        try:
            with controller.hooks({site: EditScores() for site in controller.sites}):
                active = _run_recorded(probed, inputs, attention_modules)
        except NotImplementedError as err:
            raise ValueError(f"{name}: the regularized attention cannot run this model: {err}") from None
        refuse_if_different(
            idle,
            active,
            "attn_reg_plugin's regularized kernel does not reproduce this model's attention with nothing dropped",
            "refused: every regularized step would change more than the regularizer",
        )


def _run_padded(model, probed, padded, run_own):
    """(the module run, its outputs) for the left-padded probe under the model's own attention: the
    probed module, else its backbone (a classification head without a pad token rejects a batch of two)."""
    failures = []
    candidates = [probed] + [m for m in _probe_candidates(model) if m is not probed and m is not model]
    for module in candidates:
        try:
            return module, run_own(module, _accepted(module, padded))
        except Exception as err:
            failures.append(f"{type(module).__name__}: {type(err).__name__}: {err}")
    raise ValueError(
        f"{type(model).__name__}: the left-padded probe forward that checks rows with no valid key failed "
        f"({'; '.join(failures)})"
    )


def route_attention_calls(
    model: torch.nn.Module, controller: RegularizationController, implementation: str
) -> List[Tuple[str, AttentionSite]]:
    """Give each attention call of ``model`` a site and switch the model to ``implementation``
    (an attention function already registered with transformers, whose calls ask :func:`site_of_call`).

    Returns ``(module path, site)`` pairs in forward order. Raises, naming the model, when no call
    reaches transformers' AttentionInterface, or when the switch changes the model's outputs on the
    probe input (:func:`_check_equivalent`); the model is then left as it was.
    """
    name = type(model).__name__
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise ValueError(
            f"no attention module routed through transformers' AttentionInterface was found in {name}: "
            "it is not a transformers model (no config)"
        )
    if getattr(model.config, "model_type", "").startswith("deberta"):
        raise ValueError(
            f"{name}: DeBERTa's disentangled attention does not go through transformers' "
            "AttentionInterface, so the regularizers cannot reach it"
        )
    configs = {
        id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    }
    before = {key: config._attn_implementation for key, config in configs.items()}
    previous_sites = installed_sites(model)
    set_impl = getattr(model, "set_attn_implementation", None)
    try:
        if callable(set_impl):
            set_impl(implementation)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{name} does not accept a custom attention implementation: {e}") from None
    for config in configs.values():
        config._attn_implementation = implementation
    for module in model.modules():  # a second install (the AttendOut Attacker is a copy) starts afresh
        module.__dict__.pop("attn_reg_sites", None)
    try:
        found = _install(model, controller, configs, before, implementation)
    except Exception:
        for key, config in configs.items():  # leave the model as it was
            config._attn_implementation = before[key]
        for module in model.modules():
            module.__dict__.pop("attn_reg_sites", None)
        assign_sites(model, previous_sites)
        raise
    return found


def _install(model, controller, configs, before, implementation) -> List[Tuple[str, AttentionSite]]:
    name = type(model).__name__
    probed, inputs, calls = _probe(model)
    if not calls:
        raise ValueError(
            f"no attention module routed through transformers' AttentionInterface was found in {name}: a probe "
            "forward made no call to the attention function"
        )
    paths = {id(m): p for p, m in model.named_modules()}
    # the encoder's own calls (not causal, queries as long as keys) give its input length
    encoder_len = max((kv for _, causal, q, kv in calls if q == kv and not causal), default=_ENCODER_LEN)
    depth: Dict[str, int] = {}
    found = []
    own = RegularizationController()  # the check's sites; the caller's controller gets them only if it passes
    for module, causal, q_len, kv_len in calls:
        kind = _kind(model, causal, q_len, kv_len, encoder_len)
        site = own.register(kind, depth.get(kind, 0))
        depth[kind] = depth.get(kind, 0) + 1
        module.__dict__.setdefault("attn_reg_sites", []).append(site)
        found.append((paths.get(id(module), type(module).__name__), site))
    attention_modules = list({id(m): m for m, *_ in calls}.values())
    shared = [m for m in attention_modules if len(m.attn_reg_sites) > 1]
    reset = None
    if shared:
        for module in shared:
            module.attn_reg_calls = 0
        reset = probed.register_forward_pre_hook(_reset_call_counts(shared))
    try:
        causal_lm = not getattr(model.config, "is_encoder_decoder", False) and any(c for _, c, _, _ in calls)
        _check_equivalent(
            model, own, probed, inputs, attention_modules, paths, configs, before, implementation, causal_lm
        )
    except ValueError:
        if reset is not None:  # a refused model is left as it was
            reset.remove()
        raise
    for site in own.sites:
        controller.add(site)
    logger.info("attn_reg: %s attention sites: %s", name, ", ".join(f"{k} x{n}" for k, n in depth.items()))
    return found
