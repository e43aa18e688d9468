"""deepcopy_module: a copy whose forward a library wrapped on the instance runs the copy's layers
(TRL's fused LM head closes over the original's bound forward; accelerate's autocast wrappers sit
around it), as AttendOut's Attacker must."""

import copy
import functools
import types

import pytest
import torch

from attn_reg_plugin.core.training.module_copy import deepcopy_module
from attn_reg_plugin.core.training.sharding import meta_copy

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it


class Wrapper:
    """A callable object holding the forward, as accelerate's ConvertOutputsToFp32 does."""

    def __init__(self, forward):
        self.forward = forward
        functools.update_wrapper(self, forward)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def wrapped_model(accelerate_like: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    original_forward = model.forward  # bound to this model, as TRL's add_fused_lm_head keeps it

    @functools.wraps(type(model).forward)
    def fused(self, x, doubled=False):
        return original_forward(x) * (2 if doubled else 1)

    model.forward = types.MethodType(fused, model)
    if accelerate_like:  # accelerate's native-amp wrapping: an autocast closure inside a callable object
        inner = model.forward.__func__

        def autocast_forward(*args, **kwargs):
            with torch.autocast("cpu", enabled=False):
                return inner(*args, **kwargs)

        outer = Wrapper(autocast_forward)
        model.forward = types.MethodType(lambda *args, **kwargs: outer(*args, **kwargs), model)
    return model


@pytest.mark.parametrize("accelerate_like", [False, True])
def test_a_copy_of_an_instance_wrapped_forward_runs_the_copy(accelerate_like):
    model = wrapped_model(accelerate_like)
    x = torch.ones(1, 3)
    assert torch.equal(copy.deepcopy(model)(x), model(x))  # the plain copy's forward ...
    with torch.no_grad():
        plain = copy.deepcopy(model)
        plain[0].weight.zero_()
        assert not torch.equal(plain(x), plain[0](x))  # ... runs the original's layers
        twin = deepcopy_module(model)
        twin[0].weight.zero_()
        bias = twin[0].bias.expand(1, 3)
        assert torch.equal(twin(x), bias) and torch.equal(twin(x, doubled=True), 2 * bias)
        assert not torch.equal(model(x), bias)  # the original is untouched and still runs itself
    assert twin.forward.__self__ is twin


def test_the_meta_skeleton_of_a_wrapped_model_runs_itself():
    skeleton = meta_copy(wrapped_model(accelerate_like=True))
    assert skeleton(torch.ones(1, 3, device="meta")).device.type == "meta"  # not the original's CPU layers
