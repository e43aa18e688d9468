"""core.attention_call's register of plans in progress, where threads and torch.compile meet it:
many threads read it while others register and end plans; a recompute's carried plan is its own
thread's; a pass opened inside a compiled function, or the controller's reentrant checkpoint inside
a compiled model, runs as it does eagerly."""

import sys
import threading
import time

import pytest
import torch

from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import CaptureOutput, CaptureProbs, EditScores, Plan, call_of, passing
from attn_reg_plugin.core.kernel.rules import BernoulliRule
from helpers import controller_with_sites

B, T, D, H = 2, 5, 8, 2


class _Model(torch.nn.Module):
    """Two self-attention layers through ``attend``, each checkpointed by the controller (reentrant)
    when ``checkpointed``."""

    def __init__(self, checkpointed=False):
        super().__init__()
        torch.manual_seed(0)
        self.controller = controller_with_sites({"encoder-self": 2})
        self.projections = torch.nn.ModuleList(torch.nn.Linear(D, 3 * D) for _ in self.controller.sites)
        self.checkpointed = checkpointed

    def layer(self, index, x):
        q, k, v = self.projections[index](x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        out, _ = attend(q, k, v, site=self.controller.sites[index])
        return x + out.transpose(1, 2).reshape(B, T, D)

    def forward(self, x):
        for index in range(len(self.projections)):
            if self.checkpointed:
                x = self.controller.checkpoint(self.layer, index, x, use_reentrant=True)
            else:
                x = self.layer(index, x)
        return x


def _x():
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _edit():
    return EditScores(drop=BernoulliRule(torch.tensor(0.5)), counted=True)


def test_calls_read_the_register_while_other_threads_register_and_end_plans():
    """A reader must never see the list change under it (an index past its end raised within a
    tenth of a second before the reads took a copy)."""
    controller = controller_with_sites({"encoder-self": 2})
    read, written = controller.sites
    stop, errors, reads = threading.Event(), [], [0]

    def writer():
        while not stop.is_set():
            with passing(Plan.asking({written: None})), passing(Plan.asking({written: None})):
                pass

    def reader():
        while not stop.is_set():
            try:
                assert call_of(read).hook is None
                reads[0] += 1
            except Exception as error:  # noqa: BLE001 - any error ends the test, named
                errors.append(repr(error))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert not errors and reads[0] > 1000, (errors, reads[0])


def test_a_recomputes_carried_plan_is_read_by_its_own_thread_only():
    """While one thread runs the controller's reentrant checkpoint (the pass carried in, autograd
    off), another thread's no-grad forward under the same pass is still refused: the carried plan
    is not its own."""
    model = _Model()
    site = model.controller.sites[0]
    inside, release, outcome = threading.Event(), threading.Event(), []

    def held_layer(x):
        inside.set()
        release.wait(10)
        return model.layer(0, x)

    def checkpointed_forward():
        try:
            outcome.append(model.controller.checkpoint(held_layer, _x(), use_reentrant=True))
        except Exception as error:  # noqa: BLE001 - handed to the main thread
            outcome.append(error)

    with model.controller.hooks({site: _edit()}):
        thread = threading.Thread(target=checkpointed_forward)
        thread.start()
        try:
            assert inside.wait(10)
            with pytest.raises(RuntimeError, match=r"encoder-self\[0\] ran a regularized pass with autograd off"):
                with torch.no_grad():
                    model.layer(0, _x())
        finally:
            release.set()
            thread.join()
    assert isinstance(outcome[0], torch.Tensor), outcome  # the carrying thread itself ran under its plan


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_pass_opened_inside_a_compiled_function_runs_as_eagerly(backend):
    """A compiled function that opens a capture pass inside an eager edit pass on other sites: the
    same output as eager (a plan made in the graph once could not be taken off the register)."""
    model, x = _Model(), _x()
    first, second = model.controller.sites

    def inner():
        with model.controller.hooks({first: CaptureProbs()}):
            return model(x)

    outputs = []
    for run in (inner, torch.compile(inner, backend=backend)):
        torch._dynamo.reset()
        torch.manual_seed(3)
        with model.controller.hooks({second: _edit()}):
            outputs.append(run().detach())
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("hook", ["capture", "edit"])
def test_the_controllers_reentrant_checkpoint_inside_a_compiled_model_runs_as_eagerly(hook):
    """controller.checkpoint(use_reentrant=True) in a compiled model: under AD-DROP's capture pass it
    runs the layer unchecked, under an edit through torch's checkpoint; both give eager's output."""
    model, x = _Model(checkpointed=True), _x()
    outputs = []
    for run in (model, torch.compile(model, backend="eager")):
        torch._dynamo.reset()
        torch.manual_seed(3)
        hooks = {s: CaptureOutput() if hook == "capture" else _edit() for s in model.controller.sites}
        with model.controller.hooks(hooks):
            outputs.append(run(x).detach())
    assert torch.equal(outputs[0], outputs[1])
