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

The sites belong to the model: a second install on it (a second trainer built on the same model)
finds them on the modules and registers the same sites with its own controller, so every
controller drives the same modules and none has to claim them back before its steps.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ..core.kernel.attention_call import AttentionSite, plan_of
from ..core.kernel.controller import RegularizationController
from .equivalence import check_equivalent
from .probe_inputs import DECODER_LEN, ENCODER_LEN, accepted_inputs, eval_mode, probe_candidates, probe_inputs

logger = logging.getLogger(__name__)

PLAN_KWARG = "attn_reg_plan"  # the model kwarg that carries a pass to the attention function


class UnsupportedAttention(ValueError):
    """An attention call that asks for something the plugin does not compute (logit soft-capping):
    the probe refuses the model with it, naming the difference, instead of wrapping it as a failed probe."""


def softcap_refusal(model: torch.nn.Module, err: UnsupportedAttention) -> ValueError:
    """The refusal of a model whose attention caps its logits, with what its user can do."""
    name = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"
    option = (
        "attn_logit_softcapping" if hasattr(model.config, "attn_logit_softcapping") else "<its soft-capping option>"
    )
    if getattr(model, "_supports_sdpa", False):  # Gemma-3 with a cap set: uncapped, it runs on sdpa
        fix = (
            f'Setting config.{option}=None (and attn_implementation="sdpa") makes it trainable, but as another '
            "model: a checkpoint trained with the cap attends differently wherever a score nears it, so evaluate "
            "it uncapped before training"
        )
    else:  # Gemma-2: transformers gives it no sdpa, and eager's rows with no valid key are refused
        fix = (
            f"Setting config.{option}=None is not enough: transformers runs {type(model).__name__} with eager "
            "attention only, whose left-padded rows the plugin refuses too (docs/HF.md, eager attention and left "
            "padding). The supported families without the cap (Gemma, Gemma-3) train with the plugin"
        )
    return ValueError(
        f"{name}: {err}, which attn_reg_plugin does not implement: neither its idle path (transformers' sdpa) nor "
        f"its regularized kernel applies the cap. Refused, to leave no forward silently changed. {fix}"
    )


@contextlib.contextmanager
def _recording(model: torch.nn.Module) -> Iterator[List[Tuple[torch.nn.Module, bool, int, int]]]:
    """The attention calls of ``model``'s modules while the block runs: the list is held by the
    modules themselves, so probing one model never records another's calls."""
    calls: List[Tuple[torch.nn.Module, bool, int, int]] = []
    modules = list(model.modules())
    for module in modules:
        module.__dict__["attn_reg_probe"] = calls
    try:
        yield calls
    finally:
        for module in modules:
            module.__dict__.pop("attn_reg_probe", None)


def _probe(
    model: torch.nn.Module,
) -> Tuple[torch.nn.Module, Dict[str, torch.Tensor], List[Tuple[torch.nn.Module, bool, int, int]]]:
    """(the module probed, its inputs, the attention calls it made)."""
    inputs = probe_inputs(model)
    failures = []
    for module in probe_candidates(model):
        given = accepted_inputs(module, inputs)
        try:
            with _recording(model) as calls, eval_mode(model), torch.no_grad():
                module(**given)
            return module, given, calls
        except UnsupportedAttention as err:  # the model's own attention, not the probe input: say what differs
            raise softcap_refusal(model, err) from None
        except Exception as err:  # a head that cannot take the probe input: try its backbone
            failures.append(f"{type(module).__name__}: {type(err).__name__}: {err}")
    raise ValueError(
        f"{type(model).__name__}: the probe forward that finds the attention modules failed ({'; '.join(failures)})"
    )


def _kind(model: torch.nn.Module, causal: bool, q_len: int, kv_len: int, encoder_len: int) -> str:
    if getattr(model.config, "is_encoder_decoder", False):
        if q_len == DECODER_LEN and kv_len == encoder_len != DECODER_LEN:
            return "encoder-decoder"
        return "decoder-self" if causal or q_len == DECODER_LEN else "encoder-self"
    return "decoder-self" if causal else "encoder-self"


def _reset_call_counts(modules):
    """Forward pre-hook of a model whose attention modules are called at several depths (shared
    layers): each forward numbers their calls from 0, which tells the depth of a call. A recompute
    in the backward would be numbered on, so such a model is refused under activation checkpointing."""

    def reset(model, *_args, **_kwargs):
        if getattr(model, "is_gradient_checkpointing", False):
            raise NotImplementedError(
                f"{type(modules[0]).__name__} is one attention module called at {len(modules[0].attn_reg_sites)} "
                "depths (shared layers); activation checkpointing cannot tell which depth it recomputes. "
                "Train it without gradient checkpointing"
            )
        for module in modules:
            module.attn_reg_calls = 0

    return reset


def _carry_the_pass(model: torch.nn.Module, args, kwargs):
    """Forward pre-hook of an installed model: while a pass is set on its sites, its call carries
    the pass as a model kwarg, which transformers hands to every attention call and keeps in a
    checkpointed layer's kwargs for the recompute. Sites are read from the module called (a copy
    of the model has its own)."""
    if PLAN_KWARG in kwargs or torch.compiler.is_compiling():
        return None
    holders = model.__dict__.get("attn_reg_site_holders", ())
    plan = plan_of(site for m in holders for site in m.__dict__.get("attn_reg_sites", ()))
    if not plan:
        return None
    return args, {**kwargs, PLAN_KWARG: plan}


def _carries_the_pass(model: torch.nn.Module) -> None:
    # The modules holding sites, listed once per install rather than walked every forward; a deep
    # copy of the model maps the list onto its own modules.
    model.__dict__["attn_reg_site_holders"] = [m for m in model.modules() if "attn_reg_sites" in m.__dict__]
    if "attn_reg_carries_the_pass" not in model.__dict__:  # a copy of the model has the hook already
        model.register_forward_pre_hook(_carry_the_pass, with_kwargs=True)
        model.__dict__["attn_reg_carries_the_pass"] = True


def installed_sites(model: torch.nn.Module) -> List[Tuple[str, AttentionSite]]:
    """The ``(module path, site)`` pairs the model's modules hold now, as :func:`route_attention_calls` returned them."""
    return [
        (path, site) for path, module in model.named_modules() for site in module.__dict__.get("attn_reg_sites", [])
    ]


def assign_sites(model: torch.nn.Module, pairs: List[Tuple[str, AttentionSite]]) -> None:
    """Give the modules named in ``pairs`` (from an install on this model) those sites, in order."""
    modules = dict(model.named_modules())
    grouped: Dict[str, List[AttentionSite]] = {}
    for path, site in pairs:
        grouped.setdefault(path, []).append(site)
    for path, sites in grouped.items():
        modules[path].attn_reg_sites = sites


def attention_configs(model) -> Dict[int, Any]:
    """The configs of ``model``'s modules that name an attention implementation, by id (a config
    shared by several modules once)."""
    return {
        id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    }


def route_attention_calls(
    model: torch.nn.Module, controller: RegularizationController, implementation: str
) -> List[Tuple[str, AttentionSite]]:
    """Give each attention call of ``model`` a site and switch the model to ``implementation``
    (an attention function already registered with transformers, whose calls ask
    :func:`~.attention.site_of_call`).

    Returns ``(module path, site)`` pairs in forward order. Raises, naming the model, when no call
    reaches transformers' AttentionInterface, or when the switch changes the model's outputs on the
    probe input (:func:`check_equivalent`); the model is then left as it was.
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
    configs = attention_configs(model)
    before = {key: config._attn_implementation for key, config in configs.items()}
    previous_sites = installed_sites(model)
    if previous_sites and model.__dict__.get("attn_reg_installed") == id(model):
        # A second install on this model: the same sites, driven by this controller too. (A copy of
        # an installed model, AttendOut's Attacker, carries its original's id: it is installed afresh.)
        for _, site in previous_sites:
            controller.add(site)
        _carries_the_pass(model)
        return previous_sites
    set_impl = getattr(model, "set_attn_implementation", None)
    try:
        if callable(set_impl):
            set_impl(implementation)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{name} does not accept a custom attention implementation: {e}") from None
    for config in configs.values():
        config._attn_implementation = implementation
    for module in model.modules():  # a copy of an installed model starts afresh
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
    model.__dict__["attn_reg_installed"] = id(model)
    _carries_the_pass(model)
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
    encoder_len = max((kv for _, causal, q, kv in calls if q == kv and not causal), default=ENCODER_LEN)
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
        check_equivalent(
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
