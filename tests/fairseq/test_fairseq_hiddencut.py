"""``--criterion hiddencut_label_smoothed_cross_entropy`` in-process: the objective rebuilt by hand (a clean
pass, a pass with the drawn spans of each encoder layer's fc2 output zeroed, label-smoothed CE of both
plus alpha times their JS over real target tokens), the attention statistic against fairseq's own
attention weights, the counts, the caller's sample untouched, validation one pass, the refusals."""

import copy

import pytest
import torch

pytest.importorskip("fairseq")

# registers the criterion under the package path the user dir imports (no second registration)
import attn_reg_plugin.core.regularizers.hiddencut as core_hc  # noqa: E402
import attn_reg_plugin.fairseq_plugin.hiddencut_label_smoothed_cross_entropy as hc  # noqa: E402
from helpers import TINY_TRANSFORMER, fairseq_setup  # noqa: E402

HIDDENCUT = ["--criterion", "hiddencut_label_smoothed_cross_entropy", "--label-smoothing", "0.1"]


def _setup(tiny_mt_data, task, *extra, dropout="0.1"):
    torch.manual_seed(123)  # model initialisation
    cfg, task, model, criterion = fairseq_setup(
        tiny_mt_data["bin"],
        ["--task", task, *TINY_TRANSFORMER, "--dropout", dropout, "--optimizer", "adam", *HIDDENCUT, *extra],
    )
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=600, seed=1).next_epoch_itr(shuffle=False)
    return cfg, task, model, criterion, next(iter(itr))


def _train_step(cfg, task, model, criterion, sample, seed=0):
    from fairseq.optim.adam import FairseqAdam

    optimizer = FairseqAdam(cfg.optimizer, list(model.parameters()))
    model.zero_grad()
    torch.manual_seed(seed)
    return task.train_step(sample, model, criterion, optimizer, update_num=0)


def _spy(monkeypatch):
    seen = {"spans": [], "received": []}
    spans, received = core_hc.hiddencut_spans, hc.self_attention_received

    def spy_spans(*a, **kw):
        seen["spans"].append(spans(*a, **kw))
        return seen["spans"][-1]

    def spy_received(attn, query, *a):
        seen["received"].append((attn, query.detach().clone(), *received(attn, query, *a)))
        return seen["received"][-1][2:]

    monkeypatch.setattr(core_hc, "hiddencut_spans", spy_spans)  # the step draws them in core
    monkeypatch.setattr(hc, "self_attention_received", spy_received)
    return seen


def _by_hand(model, sample, cuts, eps, pad, alpha):
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    layers = model.encoder.layers
    clean = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
    handles = [
        layer.fc2.register_forward_hook(lambda m, a, out, c=cut: out.masked_fill(c.t()[..., None], 0.0))
        for layer, cut in zip(layers, cuts)
    ]
    try:
        cut = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
    finally:
        for h in handles:
            h.remove()
    target = sample["target"]
    ce = sum(
        label_smoothed_nll_loss(lp.view(-1, lp.size(-1)), target.view(-1), eps, ignore_index=pad)[0]
        for lp in (clean, cut)
    )
    p, q = clean.exp(), cut.exp()
    m = (p + q) / 2
    js = 0.5 * ((p * (p / m).log()).sum(-1) + (q * (q / m).log()).sum(-1))
    return ce + alpha * js.masked_fill(target.eq(pad), 0.0).sum()


@pytest.mark.parametrize("task", ["attn_reg_translation", "translation"])
def test_objective_by_hand_and_the_counts(tiny_mt_data, task, monkeypatch):
    seen = _spy(monkeypatch)
    cfg, task_, model, criterion, sample = _setup(
        tiny_mt_data, task, "--hiddencut-alpha", "3", "--hiddencut-ratio", "0.3", dropout="0"
    )
    loss, sample_size, log = _train_step(cfg, task_, model, criterion, sample, seed=7)
    cuts = seen["spans"]
    assert len(cuts) == 2 and all(c.any() for c in cuts)
    src = sample["net_input"]["src_tokens"]
    valid = src.ne(criterion.padding_idx)
    assert not any((c & ~valid).any() for c in cuts)
    assert log["hiddencut_cut"] == sum(int(c.sum()) for c in cuts)
    assert log["hiddencut_tokens"] == 2 * int(valid.sum())
    assert sample_size == sample["ntokens"] and log["hiddencut_positions"] == sample["ntokens"]
    model.train()
    with torch.no_grad():
        expected = _by_hand(model, sample, cuts, 0.1, criterion.padding_idx, 3.0)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-4)


def test_attention_received_is_fairseqs_own_attention_map(tiny_mt_data, monkeypatch):
    """The statistic from the layer's q and k equals fairseq's head-averaged weights (need_weights=True),
    averaged over the real queries."""
    seen = _spy(monkeypatch)
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "translation", dropout="0")
    _train_step(cfg, task, model, criterion, sample)
    pad_mask = sample["net_input"]["src_tokens"].eq(criterion.padding_idx)
    assert pad_mask.any()  # the batch has padding
    attn, query, received, valid = seen["received"][0]
    attn.eval()
    with torch.no_grad():
        _, weights = attn(query=query, key=query, value=query, key_padding_mask=pad_mask, need_weights=True)
    expected = (weights * valid[:, :, None]).sum(1) / valid.sum(1, keepdim=True)  # (B, S): over real queries
    torch.testing.assert_close(received, expected.masked_fill(pad_mask, 0.0), rtol=1e-4, atol=1e-6)


def test_the_callers_sample_is_unchanged(tiny_mt_data):
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation")
    before = copy.deepcopy(sample)
    objects = dict(sample["net_input"])
    _train_step(cfg, task, model, criterion, sample)
    assert sample.keys() == before.keys()
    for k, v in sample["net_input"].items():
        assert v is objects[k] and torch.equal(v, before["net_input"][k]), k
    assert torch.equal(sample["target"], before["target"])


def test_validation_is_one_uncut_pass_of_the_stock_loss(tiny_mt_data):
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation")
    _train_step(cfg, task, model, criterion, sample)  # hooks installed
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    loss, _, log = task.valid_step(sample, model, criterion)
    assert len(calls) == 1 and "hiddencut_cut" not in log
    with torch.no_grad():
        stock = criterion.compute_loss(model, model(**sample["net_input"]), sample)[0]
    torch.testing.assert_close(loss, stock)


def test_the_cut_replaces_the_dropout_after_fc2(tiny_mt_data, monkeypatch):
    """As the official BertOutput: in the cut pass a cut layer's dropout_module hands fc2's cut output on
    unchanged (its call after the self-attention still drops); in the clean pass both calls drop."""
    seen = _spy(monkeypatch)
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation", dropout="0.5")
    _train_step(cfg, task, model, criterion, sample)  # hooks installed
    calls = {i: [] for i in range(len(model.encoder.layers))}
    for i, layer in enumerate(model.encoder.layers):  # registered after the criterion's: sees its output
        layer.dropout_module.register_forward_hook(lambda m, a, out, i=i: calls[i].append((a[0], out)))
    seen["spans"].clear()
    _train_step(cfg, task, model, criterion, sample, seed=5)
    for i, layer_calls in calls.items():
        (attn_clean, fc2_clean), (attn_cut, fc2_cut) = layer_calls[0:2], layer_calls[2:4]
        for x, out in (attn_clean, fc2_clean, attn_cut):
            assert not torch.equal(x, out) and out.eq(0).float().mean() > 0.3  # dropped, p = 0.5
        x, out = fc2_cut
        assert out is x  # not dropped
        cut = seen["spans"][i].t()  # (T, B)
        assert cut.any() and (x[cut] == 0).all() and (x[~cut] != 0).float().mean() > 0.99


def test_same_seed_same_step(tiny_mt_data):
    runs = []
    for _ in range(2):
        cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation")
        loss, _, log = _train_step(cfg, task, model, criterion, sample, seed=4)
        runs.append((loss.detach(), log["hiddencut_cut"], [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))


def test_reduce_metrics_logs_js_in_bits_and_summed_counts():
    from fairseq import metrics

    logs = [
        dict(loss=4.0, nll_loss=1.0, ntokens=4, nsentences=1, sample_size=4, hiddencut_js_sum=0.4,
             hiddencut_positions=4, hiddencut_cut=3, hiddencut_tokens=10),
        dict(loss=4.0, nll_loss=1.0, ntokens=4, nsentences=1, sample_size=4, hiddencut_js_sum=0.2,
             hiddencut_positions=4, hiddencut_cut=2, hiddencut_tokens=12),
    ]  # fmt: skip
    with metrics.aggregate() as agg:
        hc.HiddenCutLabelSmoothedCrossEntropyCriterion.reduce_metrics(logs)
    values = agg.get_smoothed_values()
    assert values["hiddencut_cut"] == 5 and values["hiddencut_tokens"] == 22
    assert values["hiddencut_js"] == pytest.approx(0.6 / 8 / 0.693147, abs=1e-4)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hiddencut-ratio", "0"], r"^--hiddencut-ratio must be a fraction in \(0, 1\], got 0.0$"),
        (["--hiddencut-top", "1.5"], r"^--hiddencut-top must be a fraction in \(0, 1\], got 1.5$"),
        (["--hiddencut-alpha", "-1"], r"^--hiddencut-alpha must be a finite number >= 0, got -1.0$"),
        (
            ["--attn-layerdrop-p", "0.2"],
            r"^HiddenCut \(--criterion hiddencut_label_smoothed_cross_entropy\) and attention LayerDrop "
            r"\(--attn-layerdrop-p\) do not combine in one run",
        ),
        (["--attn-drophead-schedule", "0:0.3"], r"cross_entropy\) and DropHead \(--attn-drophead-schedule\) do not"),
    ],
)
def test_refused_before_training(tiny_mt_data, extra, message):
    with pytest.raises(ValueError, match=message):
        fairseq_setup(tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER, *HIDDENCUT, *extra])


# HiddenCut ranks and cuts encoder layers: LayerDrop there, or a layer the encoder lacks, is refused when the
# criterion is built (fairseq-train builds the model first), with either task.
ENCODER_LAYERDROP = (
    r"^HiddenCut \(--criterion hiddencut_label_smoothed_cross_entropy\) ranks each selected encoder layer's "
    r"attention in the clean pass and cuts the layer in the cut pass, but --encoder-layerdrop 0.5 skips the "
    r"encoder's layers at random in training \(LayerDrop\): set --encoder-layerdrop 0 \(--decoder-layerdrop may "
    r"stay: the decoder is neither ranked nor cut\)$"
)


@pytest.mark.parametrize("task", ["translation", "attn_reg_translation"])
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--encoder-layerdrop", "0.5"], ENCODER_LAYERDROP),
        (["--hiddencut-layers", "5"], r"^--hiddencut-layers: the model has 2 encoder layers \(0-1\), got 5$"),
        (["--hiddencut-layers", "0,2"], r"^--hiddencut-layers: the model has 2 encoder layers \(0-1\), got 2$"),
    ],
)
def test_refused_when_the_criterion_is_built(tiny_mt_data, task, extra, message):
    with pytest.raises(ValueError, match=message):
        fairseq_setup(tiny_mt_data["bin"], ["--task", task, *TINY_TRANSFORMER, *HIDDENCUT, *extra])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--encoder-layerdrop", "0.5"], ENCODER_LAYERDROP[1:-1]),
        (["--hiddencut-layers", "5"], r"--hiddencut-layers: the model has 2 encoder layers \(0-1\), got 5"),
    ],
)
def test_fairseq_train_refuses_before_training(tiny_mt_data, tmp_path, extra, message):
    """The real CLI: the refusal ends fairseq-train before any data is read, and nothing is written."""
    import re

    from helpers import fairseq_train

    proc = fairseq_train(tiny_mt_data["bin"], ["--save-dir", tmp_path, *HIDDENCUT_TRAIN, *extra], expect_ok=False)
    assert proc.returncode != 0
    assert re.search("ValueError: " + message + "$", proc.stdout, flags=re.M), proc.stdout[-3000:]
    assert "begin training epoch" not in proc.stdout and not re.search(r"loaded \d+ examples", proc.stdout)
    assert not list(tmp_path.glob("*.pt"))


def test_decoder_layerdrop_and_the_last_layer_are_accepted(tiny_mt_data):
    """The decoder is neither ranked nor cut (as in the Hugging Face trainers), and 1 is a layer of 2."""
    cfg, task, model, criterion, sample = _setup(
        tiny_mt_data, "translation", "--decoder-layerdrop", "0.5", "--hiddencut-layers", "1"
    )
    _, _, log = _train_step(cfg, task, model, criterion, sample)
    assert 0 < log["hiddencut_cut"] < log["hiddencut_tokens"]
    assert criterion.hiddencut_hooks.selected == [1]


def test_what_the_options_did_not_show_is_refused_at_the_first_step(tiny_mt_data):
    """A model (or a config) changed after the criterion was built: the first step checks the model itself."""
    from fairseq.modules import LayerDropModuleList

    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "translation")
    criterion.hiddencut_config.layers = "2"
    with pytest.raises(ValueError, match=r"^--hiddencut-layers: the model has 2 encoder layers \(0-1\), got 2$"):
        _train_step(cfg, task, model, criterion, sample)
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "translation")
    model.encoder.layers = LayerDropModuleList(0.3, list(model.encoder.layers))
    refused = ENCODER_LAYERDROP.replace("--encoder-layerdrop 0.5", r"the model's encoder.layers \(p=0.3\)")
    with pytest.raises(ValueError, match=refused):
        _train_step(cfg, task, model, criterion, sample)


def test_checkpoint_activations_are_refused_at_the_first_step(tiny_mt_data):
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "translation", "--checkpoint-activations")
    with pytest.raises(ValueError, match=r"with --checkpoint-activations is not supported"):
        _train_step(cfg, task, model, criterion, sample)


# Until attn_reg_plugin/fairseq_plugin/__init__.py imports the criterion, each rank imports it itself
# (after fairseq_cli.train, which sets up fairseq-train's log format), then runs tests/fairseq_rank.py.
_RANK_LAUNCHER = (
    "import runpy, fairseq_cli.train, attn_reg_plugin.fairseq_plugin.hiddencut_label_smoothed_cross_entropy; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
HIDDENCUT_TRAIN = [
    "--task", "translation", *TINY_TRANSFORMER, *HIDDENCUT, "--dropout", "0.1", "--optimizer", "adam",
    "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--seed", "3", "--no-progress-bar", "--log-format", "json",
    "--log-interval", "1", "--no-epoch-checkpoints", "--max-epoch", "1",
]  # fmt: skip


@pytest.mark.slow  # two fairseq-train processes: about 30 s on 2 shared cores
def test_two_gloo_ranks_without_find_unused_parameters(tiny_mt_data, tmp_path):
    """fairseq-train's own loop on 2 CPU ranks (pytorch_ddp, find_unused_parameters off): both passes'
    gradients reduced once, the ranks identical, and the JSON log carries hiddencut_js, hiddencut_cut and
    hiddencut_tokens (summed over the ranks) at every update, none in validation."""
    import json
    import re
    import subprocess
    import sys

    from helpers import RANK_ENV, REPO, USER_DIR, free_port, train_updates

    save, port, procs = tmp_path / "ckpt", free_port(), []
    for rank in range(2):
        cmd = [
            sys.executable, "-c", "import sys; sys.argv = sys.argv[1:]; " + _RANK_LAUNCHER,
            str(REPO / "tests" / "fairseq_rank.py"), str(tiny_mt_data["bin"]), "--user-dir", USER_DIR,
            "--save-dir", str(save), *HIDDENCUT_TRAIN, "--ddp-backend", "pytorch_ddp",
            "--distributed-world-size", "2", "--distributed-rank", str(rank), "--distributed-no-spawn",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-backend", "gloo",
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=RANK_ENV))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs[0][-4000:] + outs[1][-4000:]
    updates = train_updates(outs[0])
    assert sorted(updates) == list(range(1, 7))  # 12 batches shared by 2 ranks
    for row in updates.values():
        assert float(row["hiddencut_js"]) > 0 and 0 < int(row["hiddencut_cut"]) < int(row["hiddencut_tokens"])
    valid = json.loads(re.search(r"\| valid \| (\{.*\})", outs[0]).group(1))
    assert not any(k.startswith("valid_hiddencut") for k in valid)
    dumps = [torch.load(save / f"params-rank{r}-update6.pt") for r in range(2)]
    assert all(torch.equal(dumps[0][k], dumps[1][k]) for k in dumps[0])
