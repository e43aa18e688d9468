"""AttendOut, scheduled attention dropout and attention LayerDrop through transformers' Trainer."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import TrainerCallback

from attn_reg_plugin.core.kernel.attention_call import hook_in_progress
from attn_reg_plugin.core.regularizers.attendout import AttendOut, AttendOutConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig, schedule_value
from attn_reg_plugin.hf import (
    AttendOutSeq2SeqTrainer,
    AttendOutTrainer,
    AttnRegSeq2SeqTrainer,
    AttnRegTrainer,
)
from attn_reg_plugin.hf.attendout_checkpoint import ATTENDOUT_STATE
from helpers import CORPUS, REPO, minilm_path, record_results, small_bert, tiny_marian, token_data, trainer_args
from helpers import MOVIE_REVIEWS_TINY as REVIEWS
from helpers import pad_collate as collate


def _args(tmp_path, cls=None, **kw):
    return trainer_args(tmp_path, cls, **{"max_steps": 6, **kw})


def attendout_trainer(tmp_path, model=None, config=None, train=None, dev=None, **kw):
    log_file = kw.pop("attendout_log_file", None)
    return AttendOutTrainer(
        model=model if model is not None else small_bert(),
        args=_args(tmp_path, **kw),
        train_dataset=train if train is not None else token_data(48, seed=1),
        eval_dataset=dev if dev is not None else token_data(12, seed=2),
        data_collator=collate,
        attendout=config if config is not None else AttendOutConfig(dropout_step=2),
        attendout_log_file=log_file,
    )


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- bad input fails at construction -------------------------------------------------------
@pytest.mark.parametrize(
    "config,message",
    [
        (AttendOutConfig(dropout_step=0), r"AttendOutConfig\.dropout_step must be an integer >= 1, got 0"),
        (AttendOutConfig(temperature=0.0), r"AttendOutConfig\.temperature must be a finite number > 0, got 0\.0"),
        (AttendOutConfig(temperature=-1.0), r"AttendOutConfig\.temperature must be a finite number > 0"),
        (AttendOutConfig(init_drop=1.5), r"AttendOutConfig\.init_drop must be in the open interval \(0, 1\), got 1\.5"),
        (AttendOutConfig(baseline_decay=1.0), r"AttendOutConfig\.baseline_decay must be in \[0, 1\)"),
        (AttendOutConfig(lr=-1e-3), r"AttendOutConfig\.lr must be a finite number > 0"),
        (AttendOutConfig(layers="5"), r"AttendOutConfig\.layers: layer 5 does not exist.*accepted indices are 0\.\.1"),
        (AttendOutConfig(layers="a"), r"AttendOutConfig\.layers must be 'all' or a comma-separated list"),
        (AttendOutConfig(attention="cross"), r"AttendOutConfig\.attention: unknown attention kind 'cross'"),
        (
            AttendOutConfig(attention="decoder-self"),
            r"attention kind 'decoder-self' was asked for, but this model has no such",
        ),
    ],
)
def test_attendout_bad_config_fails_at_construction(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        attendout_trainer(tmp_path, config=config)


def test_attendout_bad_setup_fails_at_construction(tmp_path):
    model = small_bert()
    with pytest.raises(ValueError, match="AttendOutTrainer needs eval_dataset"):
        AttendOutTrainer(
            model=model,
            args=_args(tmp_path),
            train_dataset=token_data(8, 1),
            data_collator=collate,
            attendout=AttendOutConfig(),
        )
    with pytest.raises(TypeError, match="attendout must be an AttendOutConfig"):
        AttendOutTrainer(
            model=model, args=_args(tmp_path), eval_dataset=token_data(4, 2), attendout={"dropout_step": 2}
        )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:1.5")),
            r"ScheduledDropoutConfig\.schedule: knot '0:1\.5' probability must be a probability in \[0, 1\], got 1\.5",
        ),
        (
            dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.5,0:0.2")),
            r"knot updates must increase strictly",
        ),
        (
            dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.5|0:0.1|0:0.2")),
            r"ScheduledDropoutConfig\.schedule gives 3 schedules .* 2 layers are selected",
        ),
        (
            dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.5", layers="3")),
            r"ScheduledDropoutConfig\.layers: layer 3 does not exist",
        ),
        (dict(scheduled_dropout=ScheduledDropoutConfig(schedule="")), r"ScheduledDropoutConfig\.schedule is empty"),
        (
            dict(layerdrop=AttentionLayerDropConfig(p=1.5)),
            r"AttentionLayerDropConfig\.p must be a probability in \[0, 1\], got 1\.5",
        ),
        (
            dict(layerdrop=AttentionLayerDropConfig(p=-0.1)),
            r"AttentionLayerDropConfig\.p must be a probability in \[0, 1\]",
        ),
        (
            dict(layerdrop=AttentionLayerDropConfig(p=0.5, layers="2")),
            r"AttentionLayerDropConfig\.layers: layer 2 does not exist",
        ),
        (
            dict(layerdrop=AttentionLayerDropConfig(p=0.5, attention="encoder-decoder")),
            r"'encoder-decoder' was asked for",
        ),
        (
            dict(scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.5"), layerdrop=AttentionLayerDropConfig(p=0.1)),
            r"scheduled attention dropout \(scheduled_dropout=.*\) and attention LayerDrop \(layerdrop=.*\) do not",
        ),
        (dict(), r"AttnRegTrainer needs scheduled_dropout"),
    ],
)
def test_attn_reg_bad_config_fails_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttnRegTrainer(
            model=small_bert(), args=_args(tmp_path), train_dataset=token_data(8, 1), data_collator=collate, **kwargs
        )


def test_attn_reg_trainer_names_the_trainer_of_a_regularizer_of_its_own_passes(tmp_path):
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig

    with pytest.raises(
        TypeError, match=r"ad_drop=ADDropConfig is AD-DROP, .* train it with attn_reg_plugin.hf.ADDropTrainer"
    ):
        AttnRegTrainer(
            model=small_bert(),
            args=_args(tmp_path),
            train_dataset=token_data(8, 1),
            data_collator=collate,
            ad_drop=ADDropConfig(),
        )


# -- the Defender/Attacker game ----------------------------------------------------------------
class GameWatcher(TrainerCallback):
    """Checks D == A at the start of every dropout step (after the trainer's own callback ran)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.checked_starts = 0
        self.attacker_lr = {}

    def on_step_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if t.attendout_attacker is not None and t.attendout_game.update_in_step == 0:
            assert same(params_of(t.model), params_of(t.attendout_attacker))
            self.checked_starts += 1

    def on_step_end(self, args, state, control, **kwargs):
        # The lr A stepped with this update (the scheduler has since moved D's).
        self.attacker_lr[state.global_step] = self.trainer.attendout_optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("keep_rule,accumulation", [("game", 1), ("alternate", 2)])
def test_defender_and_attacker_resync_to_one_of_the_two(tmp_path, monkeypatch, keep_rule, accumulation):
    trainer = attendout_trainer(
        tmp_path,
        max_steps=8,
        per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation,
        config=AttendOutConfig(dropout_step=2),
    )
    watcher = GameWatcher(trainer)
    trainer.add_callback(watcher)
    records = []
    original = AttendOut.finish_dropout_step

    def finish(game, d_losses, a_losses, generator=None):
        # Called after the held-out scoring, before the survivor overwrites the other network.
        assert len(d_losses) == len(a_losses) == 2  # T held-out samples
        assert len(game.cache) == 2 * accumulation  # every micro-batch of the T updates
        d_opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        before = {
            "d": params_of(trainer.model),
            "a": params_of(trainer.attendout_attacker),
            "d_moments": [d_opt.state[p]["exp_avg"].clone() for p in trainer.model.parameters()],
            "a_moments": [
                trainer.attendout_optimizer.state[p]["exp_avg"].clone() for p in trainer.attendout_attacker.parameters()
            ],
        }
        stats = original(game, d_losses, a_losses, generator)
        if keep_rule == "alternate":
            stats["keep_attacker"] = len(records) % 2 == 0
        records.append((before, stats))
        return stats

    monkeypatch.setattr(AttendOut, "finish_dropout_step", finish)
    real_finish = trainer._attendout_finish_dropout_step

    def finish_and_check():
        stats = real_finish()
        before, _ = records[-1]
        d, a = params_of(trainer.model), params_of(trainer.attendout_attacker)
        assert same(d, a)
        kept = "a" if stats["keep_attacker"] else "d"
        assert same(d, before[kept])
        assert not same(before["d"], before["a"])  # the game did diverge them during the step
        d_opt = trainer.optimizer.optimizer
        for p_d, p_a, m in zip(
            trainer.model.parameters(), trainer.attendout_attacker.parameters(), before[kept + "_moments"]
        ):
            assert torch.equal(d_opt.state[p_d]["exp_avg"], m)
            assert torch.equal(trainer.attendout_optimizer.state[p_a]["exp_avg"], m)
        return stats

    trainer._attendout_finish_dropout_step = finish_and_check
    trainer.train()
    assert len(records) == 4
    assert watcher.checked_starts == 3  # steps 3, 5, 7 (at step 1 A is built as a copy of D)
    kept = [s["keep_attacker"] for _, s in records]
    if keep_rule == "alternate":
        assert kept == [True, False, True, False]
    # The Attacker's optimizer is the Trainer's: same class, groups and hyperparameters.
    d_opt = trainer.optimizer.optimizer
    assert type(trainer.attendout_optimizer) is type(d_opt)
    for mine, theirs in zip(trainer.attendout_optimizer.param_groups, d_opt.param_groups):
        assert {k: v for k, v in mine.items() if k not in ("params", "lr")} == {
            k: v for k, v in theirs.items() if k not in ("params", "lr")
        }
        assert len(mine["params"]) == len(theirs["params"])
    # ... and its learning rate follows the Trainer's scheduler: the lr D stepped with at each update.
    logged_lr = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    assert watcher.attacker_lr == logged_lr and len(set(logged_lr.values())) == 8


def test_drop_probability_logged(tmp_path):
    log_file = tmp_path / "drop.jsonl"
    trainer = attendout_trainer(
        tmp_path, attendout_log_file=str(log_file), config=AttendOutConfig(dropout_step=2, init_drop=0.3)
    )
    trainer.train()
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [r["update"] for r in lines] == [2, 4, 6]
    logged = [h for h in trainer.state.log_history if "attendout_dropout_step" in h]
    assert [h["step"] for h in logged] == [2, 4, 6]
    for record, entry in zip(lines, logged):
        assert set(record["drop_prob"]) == {"encoder-self.0", "encoder-self.1"}
        for name, p in record["drop_prob"].items():
            assert entry[f"attendout_p_{name}"] == p
            assert abs(p - 0.3) < 0.05  # the generator starts near init_drop
        assert 0 <= entry["attendout_win_rate"] <= 1 and entry["attendout_kept_attacker"] in (0.0, 1.0)
        assert record["keep_attacker"] == bool(entry["attendout_kept_attacker"])
        # The batches are padded; the rate counts the units the Generator can mask, so it reads the
        # Generator's probability, not a fraction of it (issue 31: 0.095 logged for 0.20).
        mean_p = sum(record["drop_prob"].values()) / len(record["drop_prob"])
        assert abs(entry["attendout_drop_rate"] - mean_p) < 0.03, (entry["attendout_drop_rate"], mean_p)
    assert len({len(row["input_ids"]) for row in token_data(48, seed=1)[:8]}) > 1  # so each batch is padded
    training = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in training] == list(range(1, 7))  # the dropout-step logs do not eat training logs
    assert all(math.isfinite(h["attendout_attacker_loss"]) for h in training)


def test_same_seed_same_masks_and_losses(tmp_path, monkeypatch):
    """CPU determinism: the same seed gives the same Generator masks, rewards, losses and weights;
    another seed gives other masks."""
    from attn_reg_plugin.core.regularizers.attendout import policy as attendout_policy

    masks = record_results(monkeypatch, attendout_policy, "gumbel_drops")
    runs = []
    for seed in (0, 0, 1):
        masks.append([])
        trainer = attendout_trainer(tmp_path / f"run{len(runs)}", seed=seed, data_seed=seed)
        trainer.train()
        logs = [
            {
                k: v
                for k, v in h.items()
                if k not in ("train_runtime", "train_samples_per_second", "train_steps_per_second")
            }
            for h in trainer.state.log_history
        ]
        runs.append((logs, params_of(trainer.model)))
    assert len(masks[0]) >= 6  # one draw per update (6), plus none in evaluation
    assert len(masks[0]) == len(masks[1]) and all(torch.equal(a, b) for a, b in zip(masks[0], masks[1]))
    assert runs[0][0] == runs[1][0] and any(
        "attendout_reward" in h or "attendout_dropout_step" in h for h in runs[0][0]
    )
    assert same(runs[0][1], runs[1][1])
    assert not all(torch.equal(a, b) for a, b in zip(masks[0], masks[2]))


def test_resume_mid_dropout_step_continues_identically(tmp_path):
    config = AttendOutConfig(dropout_step=3)
    full = attendout_trainer(tmp_path / "full", config=config, max_steps=8, save_strategy="steps", save_steps=4)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-4"
    saved = torch.load(checkpoint / ATTENDOUT_STATE, map_location="cpu", weights_only=True)
    assert saved["game"]["update_in_step"] == 1 and len(saved["game"]["cache"]) == 1  # mid dropout step

    resumed = attendout_trainer(tmp_path / "resumed", config=config, max_steps=8, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def after(trainer, key):
        return [(h["step"], h[key]) for h in trainer.state.log_history if key in h and h["step"] > 4]

    for key in (
        "loss",
        "attendout_attacker_loss",
        "attendout_win_rate",
        "attendout_p_encoder-self.0",
        "attendout_baseline",
        "attendout_drop_rate",
    ):
        assert after(resumed, key) == after(full, key), key
    assert len(after(full, "loss")) == 4 and len(after(full, "attendout_win_rate")) == 1  # the step ending at 6
    assert same(params_of(resumed.model), params_of(full.model))
    assert same(params_of(resumed.attendout_attacker), params_of(full.attendout_attacker))
    assert same(params_of(resumed.attendout_generator), params_of(full.attendout_generator))


def test_resume_without_attendout_state_starts_a_new_game(tmp_path, caplog):
    plain = transformers.Trainer(
        model=small_bert(),
        args=_args(tmp_path / "plain", max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=token_data(16, 1),
        data_collator=collate,
    )
    plain.train()
    trainer = attendout_trainer(tmp_path / "ao", max_steps=4)
    with caplog.at_level("WARNING"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "out" / "checkpoint-2"))
    assert "starts a new game" in caplog.text
    assert trainer.attendout_game.dropout_steps_done == 1  # updates 3-4


# -- real models -------------------------------------------------------------------------------
def test_attendout_minilm(tmp_path):
    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    rows = [json.loads(line) for line in REVIEWS.read_text(encoding="utf-8").splitlines()[:40]]
    data = [dict(tok(r["sentence"], truncation=True, max_length=40), labels=r["label"]) for r in rows]
    trainer = AttendOutTrainer(
        model=model,
        args=_args(tmp_path, max_steps=4, learning_rate=2e-5),
        train_dataset=data[:32],
        eval_dataset=data[32:],
        data_collator=transformers.DataCollatorWithPadding(tok),
        attendout=AttendOutConfig(dropout_step=2, layers="0,5"),
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "attendout_dropout_step" in h]
    assert [h["step"] for h in logged] == [2, 4]
    assert all(0 < h["attendout_p_encoder-self.0"] < 1 and 0 < h["attendout_p_encoder-self.5"] < 1 for h in logged)
    assert all(
        math.isfinite(h["loss"]) and math.isfinite(h["attendout_attacker_loss"])
        for h in trainer.state.log_history
        if "loss" in h
    )
    assert same(params_of(trainer.model), params_of(trainer.attendout_attacker))  # T divides 4: synced at the end
    assert all(hook_in_progress(s) is None for s in trainer.attendout_game.controller.sites)


def _whitespace_pairs(n, offset=0):
    en = (CORPUS / "train.en").read_text(encoding="utf-8").splitlines()[offset : offset + n]
    ro = (CORPUS / "train.ro").read_text(encoding="utf-8").splitlines()[offset : offset + n]
    return en, ro


def _marian_data():
    en, ro = _whitespace_pairs(24)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for line in en + ro:
        for w in line.split()[:12]:
            vocab.setdefault(w, len(vocab))
    enc = lambda line: [vocab[w] for w in line.split()[:12]] + [1]  # noqa: E731
    rows = [{"input_ids": enc(a), "labels": enc(b)} for a, b in zip(en, ro)]
    return rows[:16], rows[16:], len(vocab)


def _seq2seq_collate(batch):
    def pad(seqs, value):
        n = max(len(s) for s in seqs)
        return torch.tensor([s + [value] * (n - len(s)) for s in seqs])

    ids = pad([b["input_ids"] for b in batch], 0)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": pad([b["labels"] for b in batch], -100)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attendout_seq2seq_marian(tmp_path, precision):
    train, dev, vocab_size = _marian_data()
    model = tiny_marian(vocab_size)
    args = _args(tmp_path, cls=transformers.Seq2SeqTrainingArguments, max_steps=4, bf16=precision == "bf16")
    kinds = "encoder-self,decoder-self,encoder-decoder"
    trainer = AttendOutSeq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=_seq2seq_collate,
        attendout=AttendOutConfig(dropout_step=2, attention=kinds),
    )
    # The generator reads the decoder start (Marian: the pad id) as its own token, shared table + 1 row.
    assert trainer._attendout_start_id == vocab_size
    batch = _seq2seq_collate(train[:3])
    target = trainer.attendout_streams(batch)["target"]
    assert (target[:, 0] == vocab_size).all()
    assert torch.equal(target[:, 1:], batch["labels"][:, :-1].masked_fill(batch["labels"][:, :-1] == -100, 0))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "attendout_dropout_step" in h]
    assert [h["step"] for h in logged] == [2, 4]
    names = {f"attendout_p_{k}.{i}" for k in kinds.split(",") for i in (0, 1)}
    assert all(names <= set(h) for h in logged)
    assert all(
        math.isfinite(h["loss"]) and math.isfinite(h["attendout_attacker_loss"])
        for h in trainer.state.log_history
        if "loss" in h
    )
    assert same(params_of(trainer.model), params_of(trainer.attendout_attacker))


# -- scheduled attention dropout and attention LayerDrop ---------------------------------------
def test_scheduled_dropout_follows_schedule(tmp_path):
    schedule = "0:0.6,4:0.1"
    model = small_bert()
    data = token_data(96, seed=4, min_len=12, max_len=20)
    trainer = AttnRegTrainer(
        model=model,
        args=_args(tmp_path, max_steps=6, per_device_train_batch_size=16),
        train_dataset=data,
        data_collator=collate,
        scheduled_dropout=ScheduledDropoutConfig(schedule=schedule),
    )
    trainer.train()
    knots = [(0, 0.6), (4, 0.1)]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6
    for h in logs:
        update = h["step"] - 1  # the log after update u carries u's rate
        expected = schedule_value(knots, update)
        assert h["attn_sched_dropout_p_layer0"] == h["attn_sched_dropout_p_layer1"] == pytest.approx(expected)
        # ~16 x 4 heads x 2 layers x 16^2 real units: binomial std < 0.005.
        assert abs(h["attn_sched_dropout_rate"] - expected) < 0.02, (update, h)
    assert [round(schedule_value(knots, u), 3) for u in range(6)] == [0.6, 0.475, 0.35, 0.225, 0.1, 0.1]
    # Evaluation forwards are untouched.
    assert all(hook_in_progress(s) is None for s in trainer.attn_reg_controller.sites)


def test_dropkey_preset_logs_each_layers_depth_rate(tmp_path):
    """schedule="dropkey:0.4" on 4 layers: 0.4, 0.3, 0.2, 0.1 logged at every step; the kernel's
    rate near their mean (equal units per layer; rows of 12+ keys are never all dropped here)."""
    trainer = AttnRegTrainer(
        model=small_bert(num_hidden_layers=4),
        args=_args(tmp_path, max_steps=3, per_device_train_batch_size=16),
        train_dataset=token_data(48, seed=4, min_len=12, max_len=20),
        data_collator=collate,
        scheduled_dropout=ScheduledDropoutConfig(schedule="dropkey:0.4"),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        assert [h[f"attn_sched_dropout_p_layer{i}"] for i in range(4)] == pytest.approx([0.4, 0.3, 0.2, 0.1])
        assert abs(h["attn_sched_dropout_rate"] - 0.25) < 0.02, h


def test_scheduled_dropout_only_in_training_forward(tmp_path):
    model = small_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    trainer = AttnRegTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=token_data(8, 1),
        data_collator=collate,
        scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.9"),
    )
    batch = collate(token_data(8, seed=5, min_len=10, max_len=14))
    model.eval()
    plain = model(**batch).loss
    assert torch.equal(trainer.compute_loss(model, batch), plain)  # eval mode: no hook
    model.train()
    with torch.no_grad():
        assert torch.equal(trainer.compute_loss(model, batch), plain)  # no grad (prediction): no hook
    assert not torch.allclose(trainer.compute_loss(model, batch), plain)  # training: 90% of keys dropped
    assert torch.equal(model(**batch).loss, plain)  # no hook left behind


def test_layerdrop_p1_is_exactly_uniform_through_bert_attention(tmp_path):
    model = small_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    trainer = AttnRegTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=token_data(8, 1),
        data_collator=collate,
        layerdrop=AttentionLayerDropConfig(p=1.0, layers="1"),
    )
    batch = collate(token_data(4, seed=6, min_len=4, max_len=9))
    attention = model.bert.encoder.layer[1].attention.self
    seen = {}

    def record(module, args, kwargs, output):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        seen["out"] = output[0]

    handle = attention.register_forward_hook(record, with_kwargs=True)
    model.train()
    trainer.compute_loss(model, batch)  # a training forward: hooks are set
    with torch.no_grad():
        hidden, out = seen["hidden"], seen["out"]
        values = attention.value(hidden)  # (B, S, H * d): heads side by side
        keys = batch["attention_mask"].bool()
        mean_value = (values * keys[..., None]).sum(1, keepdim=True) / keys.sum(1)[:, None, None]
        torch.testing.assert_close(out, mean_value.expand_as(out), rtol=1e-6, atol=1e-6)
        model.eval()
        model(**batch)
        assert not torch.allclose(
            seen["out"], attention.value(seen["hidden"]).mean(1, keepdim=True).expand_as(seen["out"]), atol=1e-3
        )
    handle.remove()
    # Layer 0 is not selected: never skipped, and the logged rate counts the one selected layer.
    assert trainer.attn_reg_active["layerdrop"].sites == [s for s in trainer.attn_reg_controller.sites if s.layer == 1]


def test_layerdrop_rate_logged(tmp_path):
    trainer = AttnRegTrainer(
        model=small_bert(),
        args=_args(tmp_path, max_steps=40, logging_steps=40),
        train_dataset=token_data(64, 1),
        data_collator=collate,
        layerdrop=AttentionLayerDropConfig(p=0.25),
    )
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    # 40 updates x 2 layers = 80 Bernoulli(0.25) draws: std 0.048.
    assert 0.25 - 0.15 < log["attn_layerdrop_rate"] < 0.25 + 0.15


def test_layerdrop_seq2seq_marian(tmp_path):
    train, _, vocab_size = _marian_data()
    trainer = AttnRegSeq2SeqTrainer(
        model=tiny_marian(vocab_size),
        args=_args(tmp_path, cls=transformers.Seq2SeqTrainingArguments, max_steps=2),
        train_dataset=train,
        data_collator=_seq2seq_collate,
        layerdrop=AttentionLayerDropConfig(p=1.0, attention="decoder-self,encoder-decoder"),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["attn_layerdrop_rate"] for h in logs] == [1.0, 1.0] and all(math.isfinite(h["loss"]) for h in logs)


# -- DDP -------------------------------------------------------------------------------------
DDP_WORKER = """
import sys
from pathlib import Path
import torch
from test_hf_attendout import _args, collate, small_bert, token_data
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.hf import AttendOutTrainer

out = Path(sys.argv[1])
trainer = AttendOutTrainer(model=small_bert(), args=_args(out, max_steps=4, per_device_train_batch_size=4,
                                                         save_strategy="steps", save_steps=3),
                           train_dataset=token_data(32, 1), eval_dataset=token_data(6, 2), data_collator=collate,
                           attendout=AttendOutConfig(dropout_step=2))
trainer.train()
torch.save({"d": [p.detach() for p in trainer.model.parameters()],
            "a": [p.detach() for p in trainer.attendout_attacker.parameters()],
            "g": [p.detach() for p in trainer.attendout_generator.parameters()],
            "rewards": [h["attendout_reward"] for h in trainer.state.log_history if "attendout_reward" in h]},
           out / f"final_rank{torch.distributed.get_rank()}.pt")
"""


@pytest.mark.slow
def test_attendout_ddp_two_cpu_workers(tmp_path):
    """torchrun, 2 gloo workers: A's gradients are averaged, so D, A and G stay identical on both."""
    import subprocess
    import sys

    worker = tmp_path / "worker.py"
    worker.write_text(DDP_WORKER)
    torchrun = Path(sys.executable).parent / "torchrun"
    # this test file's folder and tests/ (helpers) for the worker's imports
    paths = [str(REPO), str(Path(__file__).parent), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", str(port), str(worker), str(tmp_path)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    r0, r1 = (torch.load(tmp_path / f"final_rank{r}.pt", weights_only=True) for r in (0, 1))
    for key in ("d", "a", "g"):
        assert same(r0[key], r1[key]), key
    assert same(r0["d"], r0["a"])  # T = 2 divides 4: synced at the end
    assert r0["rewards"] == r1["rewards"] and len(r0["rewards"]) == 2
    checkpoint = tmp_path / "out" / "checkpoint-3"
    caches = [torch.load(checkpoint / f"attendout_game_rank{r}.pt", weights_only=True)["cache"] for r in (0, 1)]
    assert [len(c) for c in caches] == [1, 1]  # mid dropout step, each worker's own batch
    assert not torch.equal(caches[0][0]["streams"]["source"], caches[1][0]["streams"]["source"])
    assert (checkpoint / ATTENDOUT_STATE).is_file()


def test_a_subclass_override_of_the_trainer_hooks_is_heard(tmp_path):
    """The game's driver calls back through the trainer: overriding attendout_streams (the documented
    way to give the Generator other token streams) or the held-out logits takes effect."""
    seen = {"streams": 0, "logits": 0}

    class Traced(AttendOutTrainer):
        def attendout_streams(self, inputs):
            seen["streams"] += 1
            return super().attendout_streams(inputs)

        def _attendout_logits(self, model, batch):
            seen["logits"] += 1
            return super()._attendout_logits(model, batch)

    trainer = Traced(
        model=small_bert(),
        args=_args(tmp_path, max_steps=2),
        train_dataset=token_data(16, seed=1),
        eval_dataset=token_data(8, seed=2),
        data_collator=collate,
        attendout=AttendOutConfig(dropout_step=2),
    )
    trainer.train()
    assert seen["streams"] == 2  # one Attacker step per update
    assert seen["logits"] > 0  # the held-out evaluation at update 2 scored through the override


def _eos_padded_lm_data(n, seed):
    """Causal-LM samples of 3..9 tokens that each end in the EOS (id 2), which is also the pad id."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.cat(
            [torch.randint(3, 100, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g), torch.tensor([2])]
        )
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return samples


def _eos_padded_collate(batch):
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), 2)
    mask = torch.zeros(len(batch), n, dtype=torch.long)
    labels = torch.full((len(batch), n), -100)
    for i, b in enumerate(batch):
        ids[i, : len(b["input_ids"])], mask[i, : len(b["input_ids"])] = b["input_ids"], 1
        labels[i, : len(b["labels"])] = b["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_an_lm_whose_pad_token_is_its_eos_has_its_real_eos_tokens_in_the_game(tmp_path):
    """An LM fine-tuned with pad_token_id = eos_token_id (the usual set-up): the real EOS tokens are
    the attention mask's, not padding. The Generator's units (and the rate's denominator) are the
    real (query, earlier-or-same key) pairs of the attention mask, EOS queries and keys included."""
    from helpers import tiny_llama

    train = _eos_padded_lm_data(8, seed=1)
    trainer = AttendOutTrainer(
        model=tiny_llama(pad_token_id=2, eos_token_id=2),
        args=_args(tmp_path, max_steps=1),
        train_dataset=train,
        eval_dataset=_eos_padded_lm_data(4, seed=2),
        data_collator=_eos_padded_collate,
        attendout=AttendOutConfig(dropout_step=2, attention="decoder-self"),
    )
    batch = _eos_padded_collate(train)
    policy = trainer.attendout_generator.policies(trainer.attendout_streams(batch), trainer.attendout_driver.sites)[0]
    assert torch.equal(policy.query_real, batch["attention_mask"].bool())
    assert torch.equal(policy.key_real, batch["attention_mask"].bool())
    with pytest.warns(UserWarning, match="dropout step"):  # one update of a dropout step of 2: idle
        trainer.train()
    lengths = batch["attention_mask"].sum(-1)
    _, units = (int(c) for c in trainer.attendout_game._applied)  # what the kernel applied: one batch
    assert units == 2 * 4 * int((lengths * (lengths + 1) // 2).sum())  # causal pairs of 2 layers x 4 heads


def test_a_compute_loss_override_with_a_no_grad_forward_after_super_trains(tmp_path):
    """A subclass whose compute_loss runs a no-grad forward after super() (an extra metric) trains as
    with the other trainers: the Attacker's pass ends once its loss is made, so that forward is
    ordinary attention, while the loss's forward took the Generator's masks."""
    hooks_after_super = []

    class WithMetric(AttendOutTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model is self.attendout_attacker:
                hooks_after_super.append([hook_in_progress(site) for site in self.attendout_game.sites])
            with torch.no_grad():
                model(**inputs)
            return loss

    trainer = WithMetric(
        model=small_bert(),
        args=_args(tmp_path, max_steps=2),
        train_dataset=token_data(16, seed=1),
        eval_dataset=token_data(8, seed=2),
        data_collator=collate,
        attendout=AttendOutConfig(dropout_step=2),
    )
    trainer.train()
    assert len(hooks_after_super) == 2 and all(hook is None for hooks in hooks_after_super for hook in hooks)
    logged = [h for h in trainer.state.log_history if "attendout_drop_rate" in h]
    assert len(logged) == 1 and logged[0]["attendout_drop_rate"] > 0.05  # the Attacker's loss took the masks
