"""HF ``torch_compile=True``: every trainer trains exactly as eager and does not recompile per step.

The compiled runs use the ``aot_eager`` backend: dynamo traces and guards exactly as with
inductor (so a Python value that changed every step would recompile here too), and the traced
graph runs torch's own kernels, drawing the same random numbers as eager. So the masks, losses
and weights of a compiled run must equal the eager run's, step for step. Inductor timings are
in docs/PERFORMANCE.md ("torch.compile").
"""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from helpers import REPO, classifier_rows, tiny_bert_classifier

STEPS = 8
WARM_UP = 3  # AttendOut's first held-out evaluation (T = 2) compiles the eval graphs at step 2


# name -> (trainer builder, the log key that shows the regularizer acting)
TRAINERS = {
    "ad-drop": (
        lambda common: ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always")),
        "ad_drop_rate",
    ),
    "attendout": (
        lambda common: AttendOutTrainer(
            **common, eval_dataset=classifier_rows(4, 2), attendout=AttendOutConfig(dropout_step=2)
        ),
        "attendout_attacker_loss",
    ),
    # The probability changes at every update: as a Python float it would recompile every step.
    "scheduled-dropout": (
        lambda common: AttnRegTrainer(
            **common, scheduled_dropout=ScheduledDropoutConfig(schedule=f"0:0.5,{STEPS}:0.1")
        ),
        "attn_sched_dropout_rate",
    ),
    # A different subset of layers is skipped each step: as hooks on some sites only, one graph per subset.
    "layerdrop": (
        lambda common: AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=0.5)),
        "attn_layerdrop_rate",
    ),
}


class _GraphCount(transformers.TrainerCallback):
    """Dynamo's count of compiled graphs at the end of every step."""

    def __init__(self):
        self.after_step = []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(counters["stats"]["unique_graphs"])


def _train(tmp_path, name, compiled, backend="aot_eager", cuda=False):
    torch._dynamo.reset()
    counters.clear()
    extra = dict(torch_compile=True, torch_compile_backend=backend) if compiled else {}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        use_cpu=not cuda,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        seed=7,
        **extra,
    )
    build, key = TRAINERS[name]
    trainer = build(
        dict(model=tiny_bert_classifier(hidden_dropout_prob=0.1), args=args, train_dataset=classifier_rows(32, 1))
    )
    graphs = _GraphCount()
    trainer.add_callback(graphs)
    trainer.train()
    logs = [(h["loss"], h[key]) for h in trainer.state.log_history if "loss" in h and key in h]
    breaks = dict(counters["graph_break"])
    return logs, [p.detach().clone() for p in trainer.model.parameters()], graphs.after_step, breaks


@pytest.mark.parametrize("name", list(TRAINERS))
def test_compiled_training_equals_eager_and_compiles_once(tmp_path, name):
    eager_logs, eager_params, _, _ = _train(tmp_path, name, compiled=False)
    logs, params, graphs, breaks = _train(tmp_path, name, compiled=True)
    assert len(logs) == STEPS and len(eager_logs) == STEPS
    if name != "attendout":
        assert sum(value for _, value in logs) > 0  # the regularizer acted
    # Same masks, hence the same losses, logged rates and weights as eager.
    torch.testing.assert_close(
        torch.tensor(logs, dtype=torch.float64), torch.tensor(eager_logs, dtype=torch.float64), rtol=1e-6, atol=1e-7
    )
    for p, e in zip(params, eager_params):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-7)
    # The regularized attention traces into the model's graph: no graph break (a host read, a
    # replay record or a data-dependent branch in the kernel would each break it at every layer) ...
    assert not breaks, list(breaks)
    # ... and no graph is compiled after the warm-up: masks, rates and flags reach it as tensors.
    assert graphs[0] > 0 and graphs[WARM_UP - 1 :] == [graphs[WARM_UP - 1]] * (STEPS - WARM_UP + 1), graphs


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TRAINERS))
def test_inductor_on_cuda_compiles_once(tmp_path, name):
    """`make gpu-check`: inductor on the GPU (its own random stream, so no equality with eager):
    finite losses, the regularizer acts, no graph break, no recompile after the warm-up."""
    if not torch.cuda.is_available():
        pytest.skip("inductor on CUDA needs a GPU; the CPU test above checks the same with aot_eager")
    logs, _, graphs, breaks = _train(tmp_path, name, compiled=True, backend="inductor", cuda=True)
    assert len(logs) == STEPS and all(torch.isfinite(torch.tensor(log)).all() for log in logs)
    if name != "attendout":
        assert sum(value for _, value in logs) > 0
    assert not breaks, list(breaks)
    assert graphs[WARM_UP - 1 :] == [graphs[WARM_UP - 1]] * (STEPS - WARM_UP + 1), graphs
    print(f"inductor CUDA {name}: losses {[round(loss, 4) for loss, _ in logs]}, graphs {graphs[-1]}")


REFUSAL = (
    "does not support torch_compile=True together with gradient checkpointing: a checkpointed layer "
    "recomputed from a compiled graph cannot be told to repeat its forward's attention masks. Use one of the "
    "two (gradient_checkpointing=True is exact without torch_compile)."
)


@pytest.mark.parametrize("where", ["arguments", "model"])
def test_compile_with_gradient_checkpointing_is_refused_at_construction(tmp_path, where):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        torch_compile=True,
        gradient_checkpointing=where == "arguments",
    )
    model = tiny_bert_classifier()
    if where == "model":
        model.gradient_checkpointing_enable()
    with pytest.raises(NotImplementedError) as e:
        ADDropTrainer(model=model, args=args, ad_drop=ADDropConfig())
    assert str(e.value) == f"ADDropTrainer {REFUSAL}"
    assert REFUSAL in (REPO / "docs" / "CONFIGURATIONS.md").read_text(encoding="utf-8")
