"""AD-DROP for fairseq encoder classifiers: attn_reg_sentence_prediction + ad_drop_sentence_prediction.

End to end through fairseq-train on the 64 tiny movie reviews (sentencepiece, GLUE data
layout, a tiny randomly initialised roberta), plus in-process checks of what the CLI runs
cannot see: the attribution pass computes the criterion's own logits, its targets, and the
masks reaching every roberta self-attention layer.
"""

import re

import pytest
import torch

from attn_reg_plugin.core.kernel.attention_call import hook_in_progress

pytest.importorskip("fairseq")

from helpers import (  # noqa: E402
    SENTENCE_PREDICTION_TOKENS,
    TINY_ROBERTA,
    fairseq_setup,
    fairseq_train,
    in_child,
    run_cli,
    train_epoch_stats,
)

P, Q = 0.3, 0.5
CLI = [
    "--task",
    "attn_reg_sentence_prediction",
    *TINY_ROBERTA,
    *SENTENCE_PREDICTION_TOKENS,
    "--criterion",
    "ad_drop_sentence_prediction",
    "--ad-drop-p",
    str(P),
    "--ad-drop-q",
    str(Q),
    "--batch-size",
    "8",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--cpu",
    "--seed",
    "3",
    "--no-save",
    "--no-progress-bar",
    "--log-format",
    "simple",
    "--log-interval",
    "1",
]
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0", "--pooler-dropout", "0"]
SELF_ATTN = ["encoder.sentence_encoder.layers.0.self_attn", "encoder.sentence_encoder.layers.1.self_attn"]


def _train(data_bin, *extra):
    proc = fairseq_train(data_bin, [*CLI, *extra])
    assert "nan" not in proc.stdout.lower().replace("nan_", "")
    return proc.stdout, train_epoch_stats(proc.stdout)


def _assert_rate_about_pq(rate: str):
    # Rows here have 10-150 real keys, so rounding ceil(p*n) up adds little to p*q.
    assert P * Q * 0.95 < float(rate) < P * Q * 1.2, rate


# -- fairseq-train ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained_roberta(tiny_sp_data, tmp_path_factory):
    """A stand-in for roberta.base/model.pt: the tiny roberta after one masked_lm update with
    stock fairseq (no plugin), as RoBERTa checkpoints are made."""
    save = tmp_path_factory.mktemp("tiny_roberta_mlm")
    run_cli(
        "fairseq-train",
        [
            tiny_sp_data["cls"] / "input0",
            "--task",
            "masked_lm",
            "--criterion",
            "masked_lm",
            *TINY_ROBERTA,
            "--tokens-per-sample",
            "256",
            "--sample-break-mode",
            "complete",
            "--batch-size",
            "8",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-update",
            "1",
            "--cpu",
            "--disable-validation",
            "--no-epoch-checkpoints",
            "--save-dir",
            save,
        ],
    )
    return save / "checkpoint_last.pt"


def test_cli_fine_tune_pretrained_cross_tuning(tiny_sp_data, pretrained_roberta):
    """The GLUE recipe: restore a masked_lm checkpoint, new classification head, cross-tuning."""
    log, stats = _train(
        tiny_sp_data["cls"],
        "--num-classes",
        "2",
        "--max-epoch",
        "2",
        "--restore-file",
        pretrained_roberta,
        "--reset-optimizer",
        "--reset-dataloader",
        "--reset-meters",
    )
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 0 updates\)", log)  # strict load
    assert "Overwriting classification_heads.sentence_classification_head.out_proj.weight" in log  # fresh head
    assert set(stats) == {1, 2}
    assert stats[1]["ad_drop_on"] == "0" and stats[1]["ad_drop_rate"] == "0"  # odd epoch: plain
    assert stats[2]["ad_drop_on"] == "1"
    _assert_rate_about_pq(stats[2]["ad_drop_rate"])
    assert "accuracy" in stats[2]
    assert (
        len(re.findall(r"\| valid \| epoch 00[12] \| valid on 'valid' subset \| loss [\d.]+ .*\| accuracy", log)) == 2
    )


def test_cli_regression_ad_drop_epoch_with_find_unused_parameters(tiny_sp_data):
    """Regression (minus-the-loss target) in an AD-DROP epoch. sentence_prediction leaves the LM
    head unused, so DDP users pass --find-unused-parameters; with world size 1 fairseq does not
    wrap the model (the flag must still be accepted), the in-process DDP test covers the wrapper."""
    _, stats = _train(
        tiny_sp_data["reg"],
        "--regression-target",
        "--num-classes",
        "1",
        "--find-unused-parameters",
        "--ad-drop-schedule",
        "always",
        "--max-epoch",
        "1",
    )
    assert stats[1]["ad_drop_on"] == "1"
    _assert_rate_about_pq(stats[1]["ad_drop_rate"])
    assert "accuracy" not in stats[1]


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--ad-drop-q", "0", r"--ad-drop-q must be in the open interval \(0, 1\), got 0\.0"),
        (
            "--ad-drop-attention",
            "encoder-decoder",
            r"attention kind 'encoder-decoder' was asked for, but this model has no such attention \(it has: encoder-self\)",
        ),
    ],
)
def test_cli_bad_option_fails_before_training(tiny_sp_data, tmp_path, flag, value, message):
    proc = fairseq_train(
        tiny_sp_data["cls"],
        [*CLI, "--num-classes", "2", "--max-epoch", "1", flag, value],
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert re.search(message, proc.stdout), proc.stdout[-2000:]
    assert "begin training epoch" not in proc.stdout


# -- in process ------------------------------------------------------------------------------
def _setup(data_bin, *extra):
    torch.manual_seed(7)  # model initialisation
    cfg, task, model, criterion = fairseq_setup(
        data_bin,
        [
            "--task",
            "attn_reg_sentence_prediction",
            *TINY_ROBERTA,
            *SENTENCE_PREDICTION_TOKENS,
            "--criterion",
            "ad_drop_sentence_prediction",
            "--optimizer",
            "adam",
            "--ad-drop-p",
            str(P),
            "--ad-drop-q",
            str(Q),
            *extra,
        ],
    )
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_sentences=8, seed=1).next_epoch_itr(shuffle=False)
    return cfg, task, model, criterion, next(iter(itr))


def _record_head_outputs(model, name="sentence_classification_head"):
    seen = []
    model.classification_heads[name].register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    return seen


def test_roberta_self_attention_routed_as_encoder_self(tiny_sp_data):
    from fairseq.tasks.sentence_prediction import SentencePredictionTask

    from attn_reg_plugin.fairseq_plugin.attention import RegularizedMultiheadAttention

    cfg, task, model, _, _ = _setup(tiny_sp_data["cls"], "--num-classes", "2")
    routed = {name: m for name, m in model.named_modules() if isinstance(m, RegularizedMultiheadAttention)}
    assert sorted(routed) == SELF_ATTN
    assert [(s.kind, s.layer) for s in task.attn_reg_controller.sites] == [("encoder-self", 0), ("encoder-self", 1)]
    for layer, name in enumerate(SELF_ATTN):
        assert (routed[name].attn_reg_site.kind, routed[name].attn_reg_site.layer) == ("encoder-self", layer)
    # Parameter names are plain sentence_prediction roberta's: --restore-file checkpoints load as they are.
    plain = SentencePredictionTask.setup_task(cfg.task).build_model(cfg.model)
    assert set(model.state_dict()) == set(plain.state_dict())


@pytest.mark.parametrize(
    "data,extra",
    [
        ("cls", ["--num-classes", "2"]),
        ("cls", ["--num-classes", "2", "--ad-drop-labels", "gold"]),
        ("reg", ["--regression-target", "--num-classes", "1"]),
    ],
)
def test_attribution_forward_is_the_criterion_forward(tiny_sp_data, data, extra):
    """In eval mode the attribution pass's logits are bit-identical to those the criterion
    trains on, and its target is the pseudo/gold-label logit sum or minus the criterion's loss."""
    from attn_reg_plugin.core.regularizers.attribution_pass import bare_module

    _, task, model, criterion, sample = _setup(tiny_sp_data[data], *extra)
    model.eval()
    seen = _record_head_outputs(model)
    with torch.no_grad():
        loss, _, _ = criterion(model, sample)  # eval: the plain SentencePredictionCriterion forward
        logits = criterion.attribution_forward(bare_module(model), sample)[0]
    assert len(seen) == 2 and torch.equal(logits, seen[0])
    n_out = 1 if criterion.regression_target else 2
    assert logits.shape == (sample["nsentences"], n_out)  # the classification head, not the LM head

    value, labels = criterion.attribution_target(model, sample)((logits, None), None)
    gold = sample["target"].view(-1)
    if criterion.regression_target:
        torch.testing.assert_close(value, -loss)  # F = minus the criterion's summed squared error
    else:
        expected = gold if criterion.ad_drop_config.labels == "gold" else logits.argmax(-1)
        assert torch.equal(labels, expected)
        torch.testing.assert_close(value, logits.gather(1, expected.unsqueeze(1)).sum())


def test_masks_reach_every_roberta_self_attention_layer(tiny_sp_data):
    from attn_reg_plugin.core.kernel.attention_call import CaptureOutput, EditScores
    from attn_reg_plugin.core.kernel.rules import TopRegionRule

    _, task, model, criterion, sample = _setup(tiny_sp_data["cls"], "--num-classes", "2", *NO_DROPOUT)
    hooks_seen = {name: [] for name in SELF_ATTN}
    for name in SELF_ATTN:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(
            lambda mod, args, name=name: hooks_seen[name].append(hook_in_progress(mod.attn_reg_site))
        )
    model.train()  # dropout is 0: only AD-DROP makes the two epochs differ
    task.begin_epoch(1, model)
    plain_loss, _, plain_log = criterion(model, sample)
    assert plain_log["ad_drop_on"] == 0 and all(h == [None] for h in hooks_seen.values())

    for seen in hooks_seen.values():
        seen.clear()
    task.begin_epoch(2, model)
    torch.manual_seed(0)
    loss, _, log = criterion(model, sample)
    for name, seen in hooks_seen.items():  # pass 1 captures, pass 2 drops, in every layer
        assert [type(h) for h in seen] == [CaptureOutput, EditScores], name
        assert isinstance(seen[1].drop, TopRegionRule) and seen[1].counted, name  # the kernel draws and counts
    assert all(hook_in_progress(s) is None for s in task.attn_reg_controller.sites)
    # Every (head, query, real key) of both layers was a drop candidate position.
    tokens = sample["net_input"]["src_tokens"]
    real_keys = tokens.ne(task.source_dictionary.pad()).sum()
    assert log["ad_drop_droppable"] == 2 * 2 * tokens.shape[1] * real_keys  # layers * heads * T * keys
    _assert_rate_about_pq(log["ad_drop_dropped"] / log["ad_drop_droppable"])
    assert not torch.allclose(loss, plain_loss)


@pytest.mark.parametrize("find_unused", [True, False])
def test_ddp_wrapped_model_with_find_unused_parameters(tiny_sp_data, tmp_path, find_unused):
    """fairseq's DDP wrapping (ModuleProxyWrapper over DistributedDataParallel) around the model.
    With find_unused_parameters, AD-DROP steps train (the attribution pass runs on the bare
    model) and the unused LM head gets no gradient; without it DDP refuses the second step,
    which shows the flag is what this setup needs. In a process of its own: the DDP module keeps
    its gloo group and the group's threads alive after destroy_process_group, which in pytest's
    process would last the session (tests/conftest.py's teardown check)."""
    in_child(__file__, "_ddp_steps", str(tiny_sp_data["cls"]), str(tmp_path), find_unused)


def _ddp_steps(data_bin, tmp_path, find_unused):
    """The steps of the test above (tests/in_child.py runs them); the group one rank over a file store."""
    import torch.distributed as dist
    from fairseq.distributed import ModuleProxyWrapper
    from fairseq.optim.adam import FairseqAdam
    from torch.nn.parallel import DistributedDataParallel

    cfg, task, model, criterion, sample = _setup(data_bin, "--num-classes", "2")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        wrapped = ModuleProxyWrapper(DistributedDataParallel(model, find_unused_parameters=find_unused))
        optimizer = FairseqAdam(cfg.optimizer, list(model.parameters()))
        task.begin_epoch(2, model)

        def step(update):
            optimizer.zero_grad()
            loss, _, log = task.train_step(sample, wrapped, criterion, optimizer, update_num=update)
            optimizer.step()
            assert torch.isfinite(loss) and log["ad_drop_on"] == 1 and log["ad_drop_dropped"] > 0

        step(0)
        if not find_unused:
            with pytest.raises(RuntimeError, match="did not receive grad"):
                step(1)
            return
        step(1)
        lm_head = [p.grad for n, p in model.named_parameters() if n.startswith("encoder.lm_head.")]
        assert lm_head and all(g is None for g in lm_head)
        layer0 = model.get_submodule(SELF_ATTN[0]).q_proj.weight.grad
        assert layer0 is not None and torch.isfinite(layer0).all() and layer0.abs().sum() > 0
    finally:
        dist.destroy_process_group()


def test_ad_drop_metrics_survive_summed_logs():
    """fairseq sums the logs of workers / micro-batches before reduce_metrics when the
    criterion allows it; ad_drop_on must stay the fraction of AD-DROP steps."""
    from fairseq.logging import metrics

    from attn_reg_plugin.fairseq_plugin.ad_drop_sentence_prediction import ADDropSentencePredictionCriterion

    def log(on, dropped, valid):
        return {
            "loss": torch.tensor(1.0),
            "ntokens": 10,
            "nsentences": 2,
            "sample_size": 2,
            "ncorrect": 1,
            "ad_drop_on": on,
            "ad_drop_steps": 1,
            "ad_drop_dropped": torch.tensor(dropped),
            "ad_drop_droppable": torch.tensor(valid),
        }

    logs = [log(1, 30, 200), log(1, 10, 100)]
    summed = {k: sum(entry[k] for entry in logs) for k in logs[0]}
    assert ADDropSentencePredictionCriterion.logging_outputs_can_be_summed()
    results = []
    for given in (logs, [summed]):
        with metrics.aggregate(new_root=True) as agg:
            ADDropSentencePredictionCriterion.reduce_metrics(given)
        results.append((agg.get_smoothed_value("ad_drop_on"), agg.get_smoothed_value("ad_drop_rate")))
    assert results[0] == results[1] == (1.0, round(40 / 300, 4))
