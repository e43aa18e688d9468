"""The Hugging Face adapter: idle equivalence with sdpa, sites, exact GA, and the Trainers end to end."""

import copy
import json
import math

import pytest
import torch
import transformers  # noqa: E402

import helpers  # noqa: E402
from attn_reg_plugin.core.kernel.attention_call import (
    EditScores,  # noqa: E402
    hook_in_progress,
)
from attn_reg_plugin.core.kernel.controller import RegularizationController  # noqa: E402
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop  # noqa: E402
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig  # noqa: E402
from attn_reg_plugin.core.regularizers.attribution import logit_target  # noqa: E402
from attn_reg_plugin.hf import ADDropSeq2SeqTrainer, ADDropTrainer, install_attention_sites  # noqa: E402
from helpers import CORPUS, minilm_path, record_results, tiny_bert_classifier  # noqa: E402
from helpers import MOVIE_REVIEWS_TINY as REVIEWS


def tiny_bert(**kw):
    return tiny_bert_classifier(
        hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100, attn_implementation="sdpa", **kw
    )


def tiny_marian():
    return helpers.tiny_marian(dropout=0.0, attn_implementation="sdpa")


def bert_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def marian_batch():
    g = torch.Generator().manual_seed(2)
    src = torch.randint(3, 100, (2, 7), generator=g)
    src_mask = torch.ones_like(src)
    src_mask[1, 4:] = 0
    dec = torch.randint(3, 100, (2, 5), generator=g)
    dec[:, 0] = 0
    return {"input_ids": src.masked_fill(src_mask == 0, 0), "attention_mask": src_mask, "decoder_input_ids": dec}


def adapted(model):
    other = copy.deepcopy(model)
    controller = RegularizationController()
    sites = install_attention_sites(other, controller)
    return other, controller, sites


# -- idle equivalence and the kernel path ---------------------------------------------------
@pytest.mark.parametrize("build,batch,train", [(tiny_bert, bert_batch, False), (tiny_marian, marian_batch, True)])
def test_idle_and_noop_hook_match_sdpa(build, batch, train):
    stock = build()
    ours, controller, sites = adapted(stock)
    assert ours.config._attn_implementation == "attn_reg"
    stock.train(train)
    ours.train(train)
    inputs = batch()
    with torch.no_grad():
        expected = stock(**inputs).logits
        idle = ours(**inputs).logits
        assert torch.equal(idle, expected)
        noop = EditScores()
        with controller.hooks({s: noop for s in controller.sites}):
            hooked = ours(**inputs).logits
    torch.testing.assert_close(hooked, expected, rtol=1e-5, atol=1e-5)


def test_a_regularized_call_is_read_once(monkeypatch):
    """The adapter reads what the pass asks of a call (call_of) and hands it to attend, which does
    not read it again."""
    import attn_reg_plugin.core.kernel.attention as core_attention
    import attn_reg_plugin.hf.attention as hf_attention

    ours, controller, _ = adapted(tiny_bert())
    reads = []
    read = hf_attention.call_of
    monkeypatch.setattr(hf_attention, "call_of", lambda *args: reads.append(args) or read(*args))
    monkeypatch.setattr(core_attention, "call_of", lambda *args: pytest.fail("attend read the call again"))
    with torch.no_grad(), controller.hooks({s: EditScores() for s in controller.sites}):
        ours(**bert_batch())
    assert [site for site, _ in reads] == controller.sites  # one read per layer's call


def test_sites_found():
    _, bert_ctl, bert_sites = adapted(tiny_bert())
    assert [(s.kind, s.layer) for _, s in bert_sites] == [("encoder-self", 0), ("encoder-self", 1)]
    _, marian_ctl, marian_sites = adapted(tiny_marian())
    kinds = sorted((s.kind, s.layer) for _, s in marian_sites)
    assert kinds == sorted((k, i) for k in ("encoder-self", "decoder-self", "encoder-decoder") for i in (0, 1))
    paths = dict((p, s.kind) for p, s in marian_sites)
    assert paths["model.decoder.layers.1.encoder_attn"] == "encoder-decoder"


def test_no_attention_module_is_a_clear_error():
    with pytest.raises(ValueError, match="no attention module"):
        install_attention_sites(torch.nn.Sequential(torch.nn.Linear(2, 2)), RegularizationController())


# -- attribution through the adapter is exact ------------------------------------------------
def test_ga_through_adapter_equals_explicit_dF_dA():
    stock = tiny_bert().eval()
    inputs = bert_batch()
    # Reference: explicit attention maps from eager attention, dF/dA by autograd.
    eager = copy.deepcopy(stock)
    eager.set_attn_implementation("eager")
    out = eager(**inputs, output_attentions=True)
    value, labels = logit_target(out.logits)
    expected = torch.autograd.grad(value, list(out.attentions))

    ours, controller, _ = adapted(stock)
    ours.eval()
    ad = ADDrop(ADDropConfig(p=0.3, q=0.3), controller)
    sites, attributions, valids = ad.attributions(
        lambda: ours(**inputs), lambda o, y: logit_target(o.logits, y), frozen=ours
    )
    assert [s.layer for s in sites] == [0, 1]
    for got, want in zip(attributions, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    keys = inputs["attention_mask"].bool()
    assert torch.equal(valids[0].expand(3, 4, 9, 9)[:, 0, 0], keys)  # padding keys are invalid
    assert all(p.requires_grad for p in ours.parameters())  # unfrozen again


# -- the Trainers ----------------------------------------------------------------------------
def _args(tmp_path, cls=transformers.TrainingArguments, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=2,
        per_device_train_batch_size=16,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        learning_rate=5e-5,
        remove_unused_columns=False,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return cls(**base)


def _train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_trainer_minilm_cross_tuning(tmp_path):
    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    rows = [json.loads(line) for line in REVIEWS.read_text(encoding="utf-8").splitlines()[:32]]
    data = [dict(tok(r["sentence"], truncation=True, max_length=48), labels=r["label"]) for r in rows]
    p, q = 0.3, 0.3
    trainer = ADDropTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=data,
        data_collator=transformers.DataCollatorWithPadding(tok),
        ad_drop=ADDropConfig(p=p, q=q),
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 4
    first = [h for h in logs if h["epoch"] <= 1.0]
    second = [h for h in logs if h["epoch"] > 1.0]
    assert len(first) == 2 and len(second) == 2
    assert all(h["ad_drop_on"] == 0 and h["ad_drop_rate"] == 0 for h in first)
    for h in second:
        assert h["ad_drop_on"] == 1
        assert 0.5 * p * q < h["ad_drop_rate"] < 2 * p * q + 0.05, h
    assert all(math.isfinite(h["loss"]) for h in logs)
    # Evaluation-mode forwards are untouched after training (no hook left behind).
    assert all(hook_in_progress(s) is None for s in trainer.ad_drop_controller.sites)


def _whitespace_pairs(n):
    en = (CORPUS / "train.en").read_text(encoding="utf-8").splitlines()[:n]
    ro = (CORPUS / "train.ro").read_text(encoding="utf-8").splitlines()[:n]
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for line in en + ro:
        for w in line.split()[:12]:
            vocab.setdefault(w, len(vocab))
    enc = lambda line: [vocab[w] for w in line.split()[:12]] + [1]  # noqa: E731
    return [{"input_ids": enc(a), "labels": enc(b)} for a, b in zip(en, ro)], len(vocab)


def _collate(batch):
    def pad(seqs, value):
        n = max(len(s) for s in seqs)
        return torch.tensor([s + [value] * (n - len(s)) for s in seqs])

    ids = pad([b["input_ids"] for b in batch], 0)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": pad([b["labels"] for b in batch], -100)}


@pytest.mark.parametrize("labels", ["pseudo", "gold"])
def test_seq2seq_trainer_marian(tmp_path, labels):
    data, vocab_size = _whitespace_pairs(16)
    model = helpers.tiny_marian(vocab_size)
    args = _args(tmp_path, cls=transformers.Seq2SeqTrainingArguments, per_device_train_batch_size=8, learning_rate=1e-3)
    trainer = ADDropSeq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=_collate,
        ad_drop=ADDropConfig(p=0.3, q=0.3, attention="encoder-self,decoder-self,encoder-decoder", labels=labels),
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 4
    assert [h["ad_drop_on"] for h in logs] == [0, 0, 1, 1]
    assert all(0 < h["ad_drop_rate"] < 0.3 for h in logs[2:])
    assert all(math.isfinite(h["loss"]) for h in logs)


def test_trainer_regression_always(tmp_path):
    model = tiny_bert(num_labels=1)
    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(8):
        n = 4 + i % 4
        data.append({"input_ids": torch.randint(3, 100, (n,), generator=g), "labels": torch.tensor(float(i % 3))})

    def collate(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.stack([torch.nn.functional.pad(b["input_ids"], (0, n - len(b["input_ids"]))) for b in batch])
        return {
            "input_ids": ids,
            "attention_mask": (ids != 0).long(),
            "labels": torch.stack([b["labels"] for b in batch]),
        }

    trainer = ADDropTrainer(
        model=model,
        args=_args(tmp_path, num_train_epochs=1, per_device_train_batch_size=4),
        train_dataset=data,
        data_collator=collate,
        ad_drop=ADDropConfig(p=0.5, q=0.5, layers="1", schedule="always"),
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert [h["ad_drop_on"] for h in logs] == [1, 1]
    assert all(h["ad_drop_rate"] > 0 and math.isfinite(h["loss"]) for h in logs)


def test_trainer_same_seed_same_masks_and_losses(tmp_path, monkeypatch):
    """CPU determinism through the Trainer: the same seed gives the same masks and logs; another seed other masks."""
    from attn_reg_plugin.core.kernel import blockwise

    masks = record_results(monkeypatch, blockwise, "rule_drops", lambda made: made[0])  # each call's drops
    g = torch.Generator().manual_seed(4)
    data = [
        {"input_ids": torch.randint(3, 100, (5 + i % 4,), generator=g), "labels": torch.tensor(i % 2)}
        for i in range(12)
    ]

    def collate(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.stack([torch.nn.functional.pad(b["input_ids"], (0, n - len(b["input_ids"]))) for b in batch])
        return {
            "input_ids": ids,
            "attention_mask": (ids != 0).long(),
            "labels": torch.stack([b["labels"] for b in batch]),
        }

    runs = []
    for seed in (0, 0, 1):
        masks.append([])
        trainer = ADDropTrainer(
            model=tiny_bert(),
            args=_args(tmp_path, per_device_train_batch_size=4, seed=seed, learning_rate=1e-3),
            train_dataset=data,
            data_collator=collate,
            ad_drop=ADDropConfig(p=0.5, q=0.5),
        )
        trainer.train()
        runs.append([(h["loss"], h["grad_norm"], h["ad_drop_rate"]) for h in _train_logs(trainer)])
    assert len(masks[0]) == 3 * 2  # 3 AD-DROP steps (epoch 2) x 2 layers
    assert all(torch.equal(a, b) for a, b in zip(masks[0], masks[1]))
    assert runs[0] == runs[1]
    assert not all(torch.equal(a, b) for a, b in zip(masks[0], masks[2]))


def test_decoder_inputs_from_labels_are_the_models_own():
    """AD-DROP's pass 1 and AttendOut's held-out losses feed the decoder what the model's own
    forward builds from ``labels`` (shifted right, -100 replaced by padding)."""
    from attn_reg_plugin.hf.model_inputs import causal_lm, decoder_input_ids_from_labels

    model = tiny_marian().eval()
    labels = torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]])
    built = decoder_input_ids_from_labels(model, labels)
    start, pad = model.config.decoder_start_token_id, model.config.pad_token_id
    assert built.tolist() == [[start, 5, 6, 7], [start, 8, 2, pad]]
    src = {"input_ids": torch.tensor([[4, 5, 2], [6, 2, pad]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    with torch.no_grad():
        own = model(**src, labels=labels).logits
        ours = model(**src, decoder_input_ids=built).logits
    torch.testing.assert_close(ours, own)
    assert not causal_lm(model)
    assert causal_lm(helpers.tiny_llama())


@pytest.mark.parametrize("attribution", ["aa", "iga"])
def test_bf16_attention_attributions_drop_the_same_as_one_block_or_many(attribution, tmp_path, monkeypatch):
    """A Llama under CPU bf16 autocast (its rotary embedding hands q and k over in float32): the
    weights ranked are recomputed in float32 and pass 1's outputs are sdpa's at every length, so each
    seed's drops do not change when the calls run in blocks of 2 rows (a bf16 product of a block's
    rows, or a short map's explicit A V, is rounded otherwise: the counts differed by one)."""
    from attn_reg_plugin.core.kernel import blockwise, rules

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    mask = (torch.arange(9)[None, :] >= torch.tensor([0, 3, 5])[:, None]).long()  # left padding

    def dropped():
        counts = []
        for seed in range(4):
            ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(1 + seed)) * mask
            batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            config = ADDropConfig(p=0.5, q=0.5, schedule="always", attribution=attribution, iga_steps=3)
            trainer = ADDropTrainer(model=helpers.tiny_llama(attention_dropout=0.1), args=args, ad_drop=config)
            torch.manual_seed(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                trainer.compute_loss(trainer.model.train(), batch).backward()
            counts.append(int(trainer._ad_drop_dropped))
        return counts

    monkeypatch.setattr(rules, "CHUNK_ROWS", 2)  # draws per chunk of 2 rows in both runs
    one_block = dropped()
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
    monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)
    assert dropped() == one_block and min(one_block) > 0
