"""``--criterion rdrop_label_smoothed_cross_entropy``: R-Drop's official objective inside fairseq's own
train_step (in-process), the caller's sample untouched, validation one pass, the refusals, and a real
fairseq-train run that logs rdrop_kl (JSON and TensorBoard)."""

import copy
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fairseq")

from helpers import TINY_TRANSFORMER, fairseq_setup, fairseq_train, tensorboard_scalars, train_updates  # noqa: E402

RDROP = ["--criterion", "rdrop_label_smoothed_cross_entropy", "--label-smoothing", "0.1"]


def _setup(tiny_mt_data, task, *extra, dropout="0.1"):
    torch.manual_seed(123)  # model initialisation
    cfg, task, model, criterion = fairseq_setup(
        tiny_mt_data["bin"],
        ["--task", task, *TINY_TRANSFORMER, "--dropout", dropout, "--optimizer", "adam", *RDROP, *extra],
    )
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=600, seed=1).next_epoch_itr(shuffle=False)
    return cfg, task, model, criterion, next(iter(itr))


def _train_step(cfg, task, model, criterion, sample, seed=0):
    from fairseq.optim.adam import FairseqAdam

    optimizer = FairseqAdam(cfg.optimizer, list(model.parameters()))
    model.zero_grad()
    torch.manual_seed(seed)  # fairseq-train reseeds like this before every update
    return task.train_step(sample, model, criterion, optimizer, update_num=0)


def _official(model, sample, eps, pad, alpha, seed):
    """R-Drop's official criterion written out: the doubled batch in one forward, label-smoothed CE of
    both halves and alpha * (KL(p||q) + KL(q||p)) / 2 summed over non-pad target tokens."""
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    net_input = sample["net_input"]
    doubled = {k: torch.cat([v, v.clone()]) for k, v in net_input.items()}
    torch.manual_seed(seed)
    lprobs = model.get_normalized_probs(model(**doubled), log_probs=True)
    target = sample["target"]
    loss, _ = label_smoothed_nll_loss(
        lprobs.view(-1, lprobs.size(-1)), torch.cat([target, target]).view(-1), eps, ignore_index=pad
    )
    p, q = lprobs.chunk(2)
    pad_mask = target.unsqueeze(-1).eq(pad)
    p_loss = F.kl_div(p, q.exp(), reduction="none").masked_fill(pad_mask, 0.0).sum()
    q_loss = F.kl_div(q, p.exp(), reduction="none").masked_fill(pad_mask, 0.0).sum()
    return loss + alpha * (p_loss + q_loss) / 2


@pytest.mark.parametrize("task", ["attn_reg_translation", "translation"])
def test_concatenated_batch_is_the_official_objective(tiny_mt_data, task):
    cfg, task_, model, criterion, sample = _setup(tiny_mt_data, task, "--rdrop-alpha", "3", "--rdrop-concat-batch")
    loss, sample_size, log = _train_step(cfg, task_, model, criterion, sample, seed=7)
    model.train()
    with torch.no_grad():
        expected = _official(model, sample, 0.1, criterion.padding_idx, 3.0, seed=7)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-4)
    assert sample_size == sample["ntokens"]  # one copy's tokens, as the official criterion
    assert log["rdrop_tokens"] == sample["ntokens"] and log["rdrop_kl_sum"] > 0
    torch.testing.assert_close(log["loss"], loss.detach())


@pytest.mark.parametrize("concat", [False, True], ids=["two-forwards", "concat-batch"])
def test_the_callers_sample_is_unchanged(tiny_mt_data, concat):
    """fairseq#5410: the stock criterion concatenates sample['net_input'] in place. Here the sample dict,
    its net_input dict and every tensor are the same objects with the same values after a step."""
    cfg, task, model, criterion, sample = _setup(
        tiny_mt_data, "attn_reg_translation", *(["--rdrop-concat-batch"] if concat else [])
    )
    before = copy.deepcopy(sample)
    objects = {k: v for k, v in sample["net_input"].items()}
    net_input = sample["net_input"]
    _train_step(cfg, task, model, criterion, sample)
    assert sample.keys() == before.keys() and sample["net_input"] is net_input
    assert net_input.keys() == before["net_input"].keys()
    for k, v in net_input.items():
        assert v is objects[k] and torch.equal(v, before["net_input"][k]), k
    assert torch.equal(sample["target"], before["target"]) and sample["ntokens"] == before["ntokens"]


def test_stock_rdrop_criterion_changes_the_sample(tiny_mt_data):
    """Why the plugin registers its own criterion: fairseq's (0.12.3 and later; 0.12.2 has none) doubles
    the caller's net_input in place."""
    from fairseq.criterions import CRITERION_REGISTRY

    if "label_smoothed_cross_entropy_with_rdrop" not in CRITERION_REGISTRY:
        pytest.skip("this fairseq has no label_smoothed_cross_entropy_with_rdrop (0.12.2)")
    _, task, model, _, sample = _setup(tiny_mt_data, "translation")
    cfg, _, _, stock = fairseq_setup(
        tiny_mt_data["bin"],
        ["--task", "translation", *TINY_TRANSFORMER, "--criterion", "label_smoothed_cross_entropy_with_rdrop",
         "--rdrop-alpha", "5"],
    )  # fmt: skip
    rows = sample["net_input"]["src_tokens"].size(0)
    model.eval()
    with torch.no_grad():
        stock(model, sample)  # even in validation
    assert sample["net_input"]["src_tokens"].size(0) == 2 * rows


def test_dropout_zero_gives_no_kl_and_twice_the_plain_loss(tiny_mt_data):
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation", dropout="0")
    loss, _, log = _train_step(cfg, task, model, criterion, sample)
    assert log["rdrop_kl_sum"] == 0
    model.train()
    with torch.no_grad():
        plain = criterion.compute_loss(model, model(**sample["net_input"]), sample)[0]
    torch.testing.assert_close(loss.detach(), 2 * plain)


def test_validation_is_one_pass_of_the_stock_loss(tiny_mt_data):
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation")
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    loss, sample_size, log = task.valid_step(sample, model, criterion)
    assert len(calls) == 1 and "rdrop_kl_sum" not in log
    with torch.no_grad():
        stock = criterion.compute_loss(model, model(**sample["net_input"]), sample)[0]
    torch.testing.assert_close(loss, stock)


def test_same_seed_same_step(tiny_mt_data):
    runs = []
    for _ in range(2):
        cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation")
        loss, _, log = _train_step(cfg, task, model, criterion, sample, seed=4)
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.parametrize(
    "extra,other",
    [
        (["--attendout"], "AttendOut (--attendout)"),
        (["--attn-layerdrop-p", "0.2"], "attention LayerDrop (--attn-layerdrop-p)"),
        (["--attn-sched-dropout-schedule", "0:0.3"], "scheduled attention dropout (--attn-sched-dropout-schedule)"),
        (["--attn-sched-dropout-schedule", "dropkey:0.1"], "DropKey (--attn-sched-dropout-schedule)"),
        (["--attn-drophead-schedule", "0:0.3"], "DropHead (--attn-drophead-schedule)"),
    ],
)
def test_other_regularizers_are_refused_naming_both(tiny_mt_data, extra, other):
    with pytest.raises(ValueError) as e:
        fairseq_setup(tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER, *RDROP, *extra])
    assert str(e.value).startswith(
        f"R-Drop (--criterion rdrop_label_smoothed_cross_entropy) and {other} do not combine in one run: choose one "
        "attention regularizer per run, or one of the combinations that exist: AD-DROP + R-Drop"
    )


@pytest.mark.parametrize(
    "dropout,extra,warned",
    [("0", [], True), ("0.1", [], False), ("0", ["--encoder-layerdrop", "0.5"], False)],  # LayerDrop differs too
)
def test_a_model_without_dropout_warns_at_the_first_step(tiny_mt_data, caplog, dropout, extra, warned):
    """Its two passes are identical: the KL is 0 at every step, at twice the cost."""
    extra = ["--attention-dropout", "0", "--activation-dropout", "0", *extra]
    cfg, task, model, criterion, sample = _setup(tiny_mt_data, "attn_reg_translation", *extra, dropout=dropout)
    with caplog.at_level("WARNING", logger="attn_reg_plugin.fairseq_plugin.rdrop_label_smoothed_cross_entropy"):
        _train_step(cfg, task, model, criterion, sample)
        _train_step(cfg, task, model, criterion, sample)
    said = [r.getMessage() for r in caplog.records if "has no dropout anywhere" in r.getMessage()]
    assert said == (
        [
            "--criterion rdrop_label_smoothed_cross_entropy: TransformerModel has no dropout anywhere (every dropout, "
            "LayerDrop or drop-path probability is 0), so the two passes are identical: the KL is 0 at every step and each step costs two "
            "passes. R-Drop needs the model's dropout: set --dropout (and --attention-dropout, --activation-dropout) "
            "above 0"
        ]
        if warned
        else []
    )


def test_ad_drop_options_with_the_rdrop_criterion_are_refused_by_the_parser(tiny_mt_data, capsys):
    """R-Drop and AD-DROP are both criterions: one per run; the other's flags do not parse."""
    with pytest.raises(SystemExit):
        fairseq_setup(
            tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER, *RDROP, "--ad-drop-p", "0.3"]
        )
    assert "unrecognized arguments: --ad-drop-p 0.3" in capsys.readouterr().err


TRAIN = [
    *TINY_TRANSFORMER, "--dropout", "0.1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu",
    "--seed", "3", "--no-progress-bar", "--log-format", "json", "--log-interval", "1", "--max-epoch", "1",
    "--no-save", *RDROP,
]  # fmt: skip


# fairseq#5410: with fairseq's own criterion, --eval-bleu's validation generates from the net_input the
# criterion doubled in place and fails (IndexError in TranslationTask.valid_step, fairseq-fixed 0.12.3.1).
EVAL_BLEU = [
    "--eval-bleu",
    "--eval-bleu-args",
    '{"beam": 1, "max_len_b": 10}',
    "--eval-bleu-remove-bpe",
    "sentencepiece",
]


def test_fairseq_train_logs_rdrop_kl(tiny_mt_data, tmp_path):
    proc = fairseq_train(
        tiny_mt_data["bin"],
        ["--task", "translation", *TRAIN, "--tensorboard-logdir", tmp_path / "tb", "--rdrop-concat-batch", *EVAL_BLEU],
    )
    updates = train_updates(proc.stdout)
    assert len(updates) == 12
    kl = {u: float(r["rdrop_kl"]) for u, r in updates.items()}
    assert all(v > 0 for v in kl.values())
    nll = [float(updates[u]["nll_loss"]) for u in sorted(updates)]
    assert sum(nll[-3:]) < sum(nll[:3])  # it trains
    tb = tensorboard_scalars(tmp_path / "tb")
    assert tb["train_inner"]["rdrop_kl"] == pytest.approx(kl, abs=1e-5)
    assert "rdrop_kl" in tb["train"] and "rdrop_kl" not in tb.get("valid", {})
    valid = re.search(r"\| valid \| (\{.*\})", proc.stdout)
    record = json.loads(valid.group(1))
    assert "valid_rdrop_kl" not in record and math.isfinite(float(record["valid_loss"]))
    assert "valid_bleu" in record  # validation generated from the caller's (unchanged) sample


def test_fairseq_train_stops_on_a_bad_alpha_before_training(tiny_mt_data, tmp_path):
    proc = fairseq_train(
        tiny_mt_data["bin"],
        ["--task", "attn_reg_translation", *TRAIN, "--save-dir", tmp_path, "--rdrop-alpha", "-1"],
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert "ValueError: --rdrop-alpha must be a finite number >= 0, got -1.0" in proc.stdout
    assert "begin training epoch" not in proc.stdout and not re.search(r"loaded \d+ examples", proc.stdout)
