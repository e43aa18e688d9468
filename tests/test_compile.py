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

from attn_reg_plugin.core.ad_drop import ADDropConfig
from attn_reg_plugin.core.attendout import AttendOutConfig
from attn_reg_plugin.core.schedules import AttentionLayerDropConfig, ScheduledDropoutConfig
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, AttnRegTrainer
from conftest import tiny_bert_classifier

STEPS = 8
WARM_UP = 3  # AttendOut's first held-out evaluation (T = 2) compiles the eval graphs at step 2


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 50, (6,), generator=g), "labels": torch.tensor(i % 2)} for i in range(n)]


# name -> (trainer builder, the log key that shows the regularizer acting)
TRAINERS = {
    "ad-drop": (lambda common: ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always")),
                "ad_drop_rate"),
    "attendout": (lambda common: AttendOutTrainer(**common, eval_dataset=_rows(4, 2),
                                                  attendout=AttendOutConfig(dropout_step=2)),
                  "attendout_attacker_loss"),
    # The probability changes at every update: as a Python float it would recompile every step.
    "scheduled-dropout": (lambda common: AttnRegTrainer(**common, scheduled_dropout=ScheduledDropoutConfig(
        schedule=f"0:0.5,{STEPS}:0.1")), "attn_sched_dropout_rate"),
    # A different subset of layers is skipped each step: as hooks on some sites only, one graph per subset.
    "layerdrop": (lambda common: AttnRegTrainer(**common, layerdrop=AttentionLayerDropConfig(p=0.5)),
                  "attn_layerdrop_rate"),
}


class _GraphCount(transformers.TrainerCallback):
    """Dynamo's count of compiled graphs at the end of every step."""

    def __init__(self):
        self.after_step = []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(counters["stats"]["unique_graphs"])


def _train(tmp_path, name, compiled):
    torch._dynamo.reset()
    counters.clear()
    extra = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, report_to=[], max_steps=STEPS, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", seed=7, **extra)
    build, key = TRAINERS[name]
    trainer = build(dict(model=tiny_bert_classifier(hidden_dropout_prob=0.1), args=args, train_dataset=_rows(32, 1)))
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
    torch.testing.assert_close(torch.tensor(logs, dtype=torch.float64), torch.tensor(eager_logs, dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    for p, e in zip(params, eager_params):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-7)
    # The regularized attention traces into the model's graph: no graph break (a host read, a
    # replay record or a data-dependent branch in the kernel would each break it at every layer) ...
    assert not breaks, list(breaks)
    # ... and no graph is compiled after the warm-up: masks, rates and flags reach it as tensors.
    assert graphs[0] > 0 and graphs[WARM_UP - 1:] == [graphs[WARM_UP - 1]] * (STEPS - WARM_UP + 1), graphs


def test_compile_with_gradient_checkpointing_is_refused_at_construction(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], torch_compile=True,
                                          gradient_checkpointing=True)
    with pytest.raises(NotImplementedError, match=r"^ADDropTrainer does not support torch_compile=True together with "
                                                  r"gradient checkpointing"):
        ADDropTrainer(model=tiny_bert_classifier(), args=args, ad_drop=ADDropConfig())
