"""HiddenCut through the Hugging Face trainers (HiddenCutTrainer, HiddenCutSeq2SeqTrainer): the Trainer's
loss of a clean and a cut pass plus alpha times their JS, the cut at each layer's feed-forward output (spans drawn
from the clean pass's attention, ranked inside the model's eager or sdpa attention), for a BERT classifier, a Llama causal LM and a Marian
seq2seq model; the caller's batch untouched; gradient checkpointing; the logs; the refusals."""

import copy

import pytest
import torch
import transformers

import helpers
from attn_reg_plugin.core.regularizers import hiddencut as core
from attn_reg_plugin.core.regularizers.hiddencut import CutPlan, HiddenCutConfig, js_consistency
from attn_reg_plugin.core.regularizers.rdrop import RDropConfig
from attn_reg_plugin.hf import RDropTrainer, RDropTrainerMixin
from attn_reg_plugin.hf.feed_forward_cut import REPLACES_IT, feed_forward_output
from attn_reg_plugin.hf.hiddencut_trainer import (
    RANKED,
    RANKING_KWARG,
    HiddenCutSeq2SeqTrainer,
    HiddenCutTrainer,
    HiddenCutTrainerMixin,
    Ranking,
    hiddencut_layers,
)
from attn_reg_plugin.hf.own_passes_trainer import compared_positions
from helpers import assert_all_close_to_reference, classifier_rows, hf_tensorboard_matches_the_log, torchrun_ranks

ALPHA = 2.0


# Initialized wider than transformers' 0.02, so that a feed-forward output (what the cut zeroes) weighs
# against the residual as in a trained model; at 0.02 cutting one token moves a logit by about 1e-4.
INIT_STD = 0.3


def tiny_bert(dropout=0.1, attn_implementation="eager", **kw):
    return helpers.small_bert(
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attn_implementation,
        **{"initializer_range": INIT_STD, **kw},
    )


def bert_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}


def llama_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (3, 8), generator=g)
    return {"input_ids": ids, "labels": ids.masked_fill(torch.arange(8) >= 6, -100)}


def marian_batch():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(3, 100, (3, 6), generator=g)
    labels[2, 3:] = -100
    return {"input_ids": torch.randint(3, 100, (3, 8), generator=g), "labels": labels}


FAMILIES = {  # build, batch, seq2seq, real tokens of the batch's cut rows
    "bert": (tiny_bert, bert_batch, False, 9 + 6 + 3),
    "llama": (
        lambda dropout=0.1: helpers.tiny_llama(attention_dropout=dropout, attn_implementation="eager"),
        llama_batch,
        False,
        24,
    ),
    "marian": (
        lambda dropout=0.1: helpers.tiny_marian(dropout=dropout, attn_implementation="eager", init_std=INIT_STD),
        marian_batch,
        True,
        24,
    ),
}


def _args(tmp_path, seq2seq=False, **kw):
    cls = transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments
    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no")
    return cls(**{**base, "remove_unused_columns": False, **kw})


def make_trainer(family, tmp_path, model=None, **config):
    build, _, seq2seq, _ = FAMILIES[family]
    cls = HiddenCutSeq2SeqTrainer if seq2seq else HiddenCutTrainer
    config = HiddenCutConfig(**{"alpha": ALPHA, **config})
    return cls(model=model or build(), args=_args(tmp_path, seq2seq), hiddencut=config)


def one_step(trainer, batch, seed=5):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); one step is taken here by hand
    torch.manual_seed(seed)
    loss = trainer.training_step(trainer.model, batch)
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def _spy_spans(monkeypatch):
    drawn = []

    def spans(*args, **kwargs):
        drawn.append(real(*args, **kwargs))
        return drawn[-1]

    real = core.hiddencut_spans
    monkeypatch.setattr("attn_reg_plugin.core.regularizers.hiddencut.hiddencut_spans", spans)
    return drawn


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_clean_plus_cut_plus_alpha_js_and_the_cut_is_counted(family, tmp_path, monkeypatch):
    """Without dropout the two passes differ by the cut alone: the loss is rebuilt from the drawn spans."""
    build, make_batch, _, real_tokens = FAMILIES[family]
    model = build(dropout=0.0)
    drawn = _spy_spans(monkeypatch)
    trainer = make_trainer(family, tmp_path, model=model)
    batch = make_batch()
    loss, grads = one_step(trainer, batch)
    assert torch.isfinite(loss) and grads
    assert len(drawn) == 2  # one span per row in each of the 2 layers; floor(0.1 * n) <= 1: one token each
    assert all(int(cut.sum()) == 3 and cut.sum(1).tolist() == [1, 1, 1] for cut in drawn)
    stats = trainer.hiddencut_stats()
    assert stats["hiddencut_cut"] == 6 and stats["hiddencut_tokens"] == 2 * real_tokens
    valid = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    plan = CutPlan({i: (cut, valid) for i, cut in enumerate(drawn)})
    model.train()
    with torch.no_grad():
        clean, cut = model(**batch), model(**batch, hiddencut_plan=plan)
    first, second, _, keep = compared_positions(trainer, model, batch, clean.logits, cut.logits, "JS")
    js, positions = js_consistency(first, second, keep)
    assert js > 0 and not torch.equal(clean.logits, cut.logits)
    torch.testing.assert_close(loss, clean.loss + cut.loss + ALPHA * js / positions, rtol=1e-5, atol=1e-6)


def test_js_is_normalized_as_the_models_loss_over_the_accumulated_batch(tmp_path, monkeypatch):
    """A causal LM takes num_items_in_batch: its loss is the summed CE over them, and so is the JS."""
    model = FAMILIES["llama"][0](dropout=0.0)
    drawn = _spy_spans(monkeypatch)
    args = _args(tmp_path, gradient_accumulation_steps=4)
    trainer = HiddenCutTrainer(model=model, args=args, hiddencut=HiddenCutConfig(alpha=ALPHA))
    assert trainer.model_accepts_loss_kwargs
    batch = llama_batch()
    items = torch.tensor(4 * int(batch["labels"][:, 1:].ne(-100).sum()))  # as if 4 micro-batches made the update
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(model, batch, num_items_in_batch=items)
    plan = CutPlan({i: (cut, torch.ones_like(cut)) for i, cut in enumerate(drawn)})
    with torch.no_grad():
        clean = model(**batch, num_items_in_batch=items)
        cut = model(**batch, num_items_in_batch=items, hiddencut_plan=plan)
    first, second, _, keep = compared_positions(trainer, model, batch, clean.logits, cut.logits, "JS")
    js, _ = js_consistency(first, second, keep)
    torch.testing.assert_close(loss.detach(), clean.loss + cut.loss + ALPHA * js / items, rtol=1e-5, atol=1e-6)


def test_js_is_normalized_as_a_bert_classifiers_loss_which_ignores_the_accumulated_batch(tmp_path, monkeypatch):
    """BERT's classifier takes loss keywords but returns its plain mean over the micro-batch: the JS is
    divided by the micro-batch's samples too, so alpha keeps its weight under gradient accumulation."""
    model = FAMILIES["bert"][0](dropout=0.0)
    with torch.no_grad():
        model.classifier.weight.mul_(10.0)  # logits far enough apart that the passes' JS is well above rounding
    drawn = _spy_spans(monkeypatch)
    args = _args(tmp_path, gradient_accumulation_steps=4)
    trainer = HiddenCutTrainer(model=model, args=args, hiddencut=HiddenCutConfig(alpha=ALPHA))
    assert trainer.model_accepts_loss_kwargs
    batch = bert_batch()
    trainer.model.train()
    loss = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(4 * 3))  # 4 micro-batches of 3
    plan = CutPlan({i: (cut, batch["attention_mask"].bool()) for i, cut in enumerate(drawn)})
    with torch.no_grad():
        clean, cut = model(**batch), model(**batch, hiddencut_plan=plan)
    js, positions = js_consistency(clean.logits, cut.logits)
    assert int(positions) == 3 and js > 1e-3  # large enough that dividing it by 12 items instead shows
    torch.testing.assert_close(loss.detach(), clean.loss + cut.loss + ALPHA * js / 3, rtol=1e-5, atol=1e-6)


# Each family's feed-forward output before the residual, as the official code cuts it (BertOutput).
FEED_FORWARD = {
    "bert": lambda layer: layer.output.dense,
    "llama": lambda layer: layer.mlp,
    "marian": lambda layer: layer.fc2,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cut_pass_is_the_model_with_its_feed_forward_outputs_zeroed_at_the_spans(family, tmp_path, monkeypatch):
    """Against the model run by hand with each layer's feed-forward output zeroed at its span by a hook of
    the test's own: the same logits (no dropout, so both passes are deterministic)."""
    drawn = _spy_spans(monkeypatch)
    build, make_batch, _, _ = FAMILIES[family]
    trainer = make_trainer(family, tmp_path, model=build(dropout=0.0), ratio=0.5)
    model, batch = trainer.model, make_batch()
    logits = []
    handle = model.register_forward_hook(lambda m, a, out: logits.append(out.logits.detach()))
    one_step(trainer, batch)
    handle.remove()
    clean, cut = logits
    layers = hiddencut_layers(model)
    assert len(drawn) == len(layers) and all(int(span.sum()) > 0 for span in drawn)
    hooks = [
        FEED_FORWARD[family](layer).register_forward_hook(
            lambda m, a, out, span=span: out * (~span).unsqueeze(-1).to(out.dtype)
        )
        for layer, span in zip(layers, drawn)
    ]
    with torch.no_grad():
        by_hand = model(**batch).logits
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(cut, by_hand, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(cut, clean, atol=1e-3)


def test_the_cut_takes_the_place_of_berts_feed_forward_dropout(tmp_path, monkeypatch):
    """As the official BertOutput: in the cut pass the feed-forward output is the dense layer's, zeroed at
    the span and not dropped out; the clean pass keeps its dropout."""
    drawn = _spy_spans(monkeypatch)
    trainer = make_trainer("bert", tmp_path, model=tiny_bert(dropout=0.3), ratio=0.5)
    dense, dropped = [], []
    for layer in trainer.model.bert.encoder.layer:
        layer.output.dense.register_forward_hook(lambda m, a, out: dense.append(out.detach()))
        layer.output.dropout.register_forward_hook(lambda m, a, out: dropped.append(out.detach()))
    one_step(trainer, bert_batch())
    layers = len(trainer.model.bert.encoder.layer)
    for index in range(layers):
        assert not torch.equal(dropped[index], dense[index])  # the clean pass drops out
        span = drawn[index]
        cut_dense, cut_dropped = dense[layers + index], dropped[layers + index]
        assert torch.equal(cut_dropped, cut_dense * (~span).unsqueeze(-1))


def test_the_cut_takes_the_place_of_marians_functional_dropout_after_fc2(tmp_path, monkeypatch):
    """BART-family layers drop fc2's output with a functional dropout before the residual: in the cut pass
    the residual adds fc2's cut output undropped; the clean pass drops it."""
    drawn = _spy_spans(monkeypatch)
    trainer = make_trainer("marian", tmp_path, model=FAMILIES["marian"][0](dropout=0.3), ratio=0.5)
    layers = hiddencut_layers(trainer.model)
    seen = {"residual": [], "fc2": [], "sum": []}
    for layer in layers:  # post-norm: final_layer_norm(residual + dropout(fc2(...))), residual = fc1's input
        layer.fc1.register_forward_hook(lambda m, a, out: seen["residual"].append(a[0].detach()))
        layer.fc2.register_forward_hook(lambda m, a, out: seen["fc2"].append(out.detach()))
        layer.final_layer_norm.register_forward_hook(lambda m, a, out: seen["sum"].append(a[0].detach()))
    one_step(trainer, FAMILIES["marian"][1]())
    n = len(layers)
    assert all(len(v) == 2 * n for v in seen.values())
    for index in range(n):
        clean, cut = index, n + index
        residual, fc2, total = (seen[k][cut] for k in ("residual", "fc2", "sum"))
        assert (fc2[drawn[index]] == 0).all() and (fc2[~drawn[index]] != 0).float().mean() > 0.99
        assert torch.equal(total, residual + fc2)  # the cut pass: not dropped
        residual, fc2, total = (seen[k][clean] for k in ("residual", "fc2", "sum"))
        assert ((total - residual) == 0).float().mean() > 0.2  # the clean pass: dropped out (p = 0.3)


def test_a_layer_without_a_known_feed_forward_output_has_its_output_cut_and_says_so(tmp_path, monkeypatch):
    drawn = _spy_spans(monkeypatch)
    monkeypatch.setattr("attn_reg_plugin.hf.hiddencut_trainer.feed_forward_output", lambda layer: None)
    with pytest.warns(UserWarning, match="no feed-forward output found in BertLayer; the cut zeroes those layers"):
        trainer = make_trainer("bert", tmp_path, ratio=0.5)
    outputs = []
    for layer in trainer.model.bert.encoder.layer:
        layer.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    one_step(trainer, bert_batch())
    clean, cut = outputs[:2], outputs[2:]
    for index in range(2):
        span = drawn[index]
        assert int(span.sum()) >= 3 and span.sum(1).tolist() != [0, 0, 0]
        assert cut[index][span].abs().sum() == 0
        assert (cut[index][~span].abs().sum(-1) > 0).all()
        assert (clean[index].abs().sum(-1) > 0).all()


def test_a_feed_forward_run_in_chunks_is_cut_as_the_whole_sequence(tmp_path):
    """BERT with chunk_size_feed_forward runs its feed-forward block (and the dropout the cut replaces)
    once per chunk of positions: the same loss, gradients and counts as without chunks."""
    steps, stats = [], []
    for chunk in (0, 3):  # 9 positions: 3 chunks
        trainer = make_trainer("bert", tmp_path, model=tiny_bert(dropout=0.0, chunk_size_feed_forward=chunk), ratio=0.5)
        steps.append(one_step(trainer, bert_batch()))
        stats.append(trainer.hiddencut_stats())
    torch.testing.assert_close(steps[1][0], steps[0][0], rtol=1e-5, atol=0)
    for a, b in zip(steps[1][1], steps[0][1]):
        # chunks change the matmuls' shapes, so float rounding: seen up to 2.5e-7 on gradients of ~1e-2
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [s["hiddencut_cut"] for s in stats] == [stats[0]["hiddencut_cut"]] * 2 and stats[0]["hiddencut_cut"] > 3
    assert stats[1]["hiddencut_js"] == pytest.approx(stats[0]["hiddencut_js"], rel=1e-5)


@pytest.mark.parametrize("name", ["BERT", "T5 / Flan-T5"])
def test_wrapping_by_layer_class_name_still_finds_every_layer(name, tmp_path):
    """FSDP's auto-wrap policy finds the layer class by name: every layer of that class (T5's decoder
    blocks too, of the encoder's class) must still be one, after the trainer set the model up."""
    from types import SimpleNamespace

    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from families import FAMILIES as ALL
    from families import build
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model = build(next(f for f in ALL if f.name == name))
    model.set_attn_implementation("eager")
    kind = type(hiddencut_layers(model)[0])
    blocks = [m for m in model.modules() if isinstance(m, kind)]

    def wrapped():
        asked = SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy, transformer_cls_names_to_wrap=None)
        policy = fsdp2_prepare_auto_wrap_policy(asked, model)
        return [policy(block) for block in blocks]

    assert all(wrapped()) and len(blocks) >= 2
    seq2seq = model.config.is_encoder_decoder
    cls = HiddenCutSeq2SeqTrainer if seq2seq else HiddenCutTrainer
    cls(model=model, args=_args(tmp_path, seq2seq), hiddencut=HiddenCutConfig())
    assert all(wrapped()) and len({type(block) for block in blocks}) == 1


def test_a_model_that_does_not_pass_the_cut_to_its_layers_is_refused_at_the_first_step(tmp_path):
    """Bloom calls its blocks without the model's keyword arguments: neither the clean pass's ranking nor
    the cut pass's plan arrives, and a step that ranked or cut nothing must not pass for HiddenCut."""
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=100, attn_implementation="eager")
    model = transformers.BloomForCausalLM(config)
    trainer = HiddenCutTrainer(model=model, args=_args(tmp_path), hiddencut=HiddenCutConfig())
    with pytest.raises(ValueError, match=r"layers \[0, 1\] of BloomForCausalLM made no attention call .* keyword"):
        one_step(trainer, llama_batch())


def test_a_feed_forward_block_that_returns_a_tuple_is_cut_in_its_hidden_states(tmp_path, monkeypatch):
    """GPT-OSS's mixture-of-experts `mlp` returns (hidden states, router scores): the first is cut."""
    drawn = _spy_spans(monkeypatch)
    config = transformers.GptOssConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"] * 2, pad_token_id=0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager")
    trainer = HiddenCutTrainer(model=model, args=_args(tmp_path), hiddencut=HiddenCutConfig(ratio=0.5))
    outputs = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, a, out: outputs.append(out))
    one_step(trainer, llama_batch())
    layers = len(model.model.layers)
    for index, span in enumerate(drawn):
        hidden = outputs[layers + index][0]
        assert hidden[span].abs().sum() == 0 and (hidden[~span].abs().sum(-1) > 0).all()
    assert torch.equal(outputs[layers][1], outputs[0][1])  # layer 0's router scores (same input) pass unchanged
    assert trainer.hiddencut_stats()["hiddencut_cut"] == sum(int(s.sum()) for s in drawn)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_trainer_on_the_same_model_cuts_as_the_first(family, tmp_path):
    """The first trainer's hooks stay on the model (and a deepcopy copies them): the second trainer's
    step is the step of a first trainer on a fresh copy of the model."""
    build, make_batch, _, _ = FAMILIES[family]
    model = build(dropout=0.0)
    fresh = copy.deepcopy(model)
    one_step(make_trainer(family, tmp_path, model=model, ratio=0.5), make_batch())
    model.load_state_dict(fresh.state_dict())
    again = one_step(make_trainer(family, tmp_path, model=model, ratio=0.5), make_batch())
    first = one_step(make_trainer(family, tmp_path, model=fresh, ratio=0.5), make_batch())
    torch.testing.assert_close(again[0], first[0], rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_the_second_trainer_does_not_cut_keeps_its_dropout(family, tmp_path):
    """The first trainer's hook on layer 0 sees the second trainer's plan, which cuts layer 1 only:
    layer 0 keeps the dropout a cut would replace, and the step is a lone layers="1" trainer's."""
    build, make_batch, _, _ = FAMILIES[family]
    model = build(dropout=0.3)
    fresh = copy.deepcopy(model)
    make_trainer(family, tmp_path, model=model, ratio=0.5, layers="0")
    second = one_step(make_trainer(family, tmp_path, model=model, ratio=0.5, layers="1"), make_batch())
    alone = one_step(make_trainer(family, tmp_path, model=fresh, ratio=0.5, layers="1"), make_batch())
    torch.testing.assert_close(second[0], alone[0], rtol=0, atol=0)


def test_a_model_with_layerdrop_is_refused_naming_the_setting(tmp_path):
    """A layer skipped at random has no map in the clean pass or no cut in the cut pass. What counts is
    the ``layerdrop`` the forward reads, which transformers copies from the config into the encoder."""
    model = helpers.tiny_marian(dropout=0.0, attn_implementation="eager", encoder_layerdrop=0.1)
    refused = r"MarianMTModel's model.encoder skips its layers at random in training \(LayerDrop, layerdrop=0.1\)"
    with pytest.raises(ValueError, match=refused):
        HiddenCutSeq2SeqTrainer(model=model, args=_args(tmp_path, True), hiddencut=HiddenCutConfig())
    model.config.encoder_layerdrop = 0.0  # too late: the encoder kept its copy
    with pytest.raises(ValueError, match=refused):
        HiddenCutSeq2SeqTrainer(model=model, args=_args(tmp_path, True), hiddencut=HiddenCutConfig())
    model.model.encoder.layerdrop = 0.0
    model.model.decoder.layerdrop = 0.3  # the decoder is neither ranked nor cut
    HiddenCutSeq2SeqTrainer(model=model, args=_args(tmp_path, True), hiddencut=HiddenCutConfig())


def test_a_speech_encoder_that_reads_layerdrop_from_its_config_is_refused(tmp_path):
    """wav2vec2-style encoders read config.layerdrop in the forward (no copy on a module): 0.1 by default."""
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=20,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.Wav2Vec2ForCTC(config)
    with pytest.raises(ValueError, match=r"Wav2Vec2ForCTC's config skips its layers at random .*layerdrop=0.1"):
        HiddenCutTrainer(model=model, args=_args(tmp_path), hiddencut=HiddenCutConfig())


def test_data_parallel_is_refused(tmp_path):
    args = _args(tmp_path)
    args._n_gpu = 2  # what TrainingArguments reports for one process driving two GPUs
    with pytest.raises(ValueError, match=r"HiddenCut does not support DataParallel \(one process with n_gpu=2"):
        HiddenCutTrainer(model=tiny_bert(), args=args, hiddencut=HiddenCutConfig())
    with pytest.raises(ValueError, match=r"R-Drop does not support DataParallel"):
        RDropTrainer(model=tiny_bert(), args=args, rdrop=RDropConfig())


def test_every_family_with_layers_has_its_feed_forward_output_found():
    """Each family of the table (ALBERT has no checkpointed layer, and is refused): a dropout the cut
    replaces, or a module whose output is cut."""
    from families import FAMILIES as ALL
    from families import build

    for family in ALL:
        layers = hiddencut_layers(build(family)) if family.name != "ALBERT" else []
        for layer in layers:
            found = feed_forward_output(layer)
            assert found is not None, family.name
            assert isinstance(found[0], torch.nn.Dropout) == (found[1] == REPLACES_IT), family.name


def test_the_callers_batch_is_unchanged(tmp_path):
    args = _args(tmp_path, label_smoothing_factor=0.1)
    trainer = HiddenCutTrainer(model=tiny_bert(), args=args, hiddencut=HiddenCutConfig())
    batch = bert_batch()
    before, tensors = copy.deepcopy(batch), dict(batch)
    loss, _ = one_step(trainer, batch)
    assert batch.keys() == before.keys() and torch.isfinite(loss)
    for k, v in batch.items():
        assert v is tensors[k] and torch.equal(v, before[k]), k


def test_same_seed_same_step(tmp_path):
    steps = [one_step(make_trainer("bert", tmp_path), bert_batch(), seed=3) for _ in range(2)]
    assert torch.equal(steps[0][0], steps[1][0])
    assert all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1]))
    assert not torch.equal(steps[0][0], one_step(make_trainer("bert", tmp_path), bert_batch(), seed=4)[0])


@pytest.mark.parametrize("family", ["bert", "llama", "marian"])
def test_gradient_checkpointing_gives_the_same_loss_gradients_and_counts(family, tmp_path):
    """transformers 5.x checkpoints a layer's forward with its keywords: the recompute holds the same plan,
    and its feed-forward hook (inside the recompute) cuts the same tokens, counted once."""
    batch = FAMILIES[family][1]()
    plain = make_trainer(family, tmp_path, ratio=0.5)
    loss, grads = one_step(plain, batch)
    for reentrant in (True, False):
        model = FAMILIES[family][0]()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        trainer = make_trainer(family, tmp_path, model=model, ratio=0.5)
        loss_ck, grads_ck = one_step(trainer, batch)
        torch.testing.assert_close(loss_ck, loss, rtol=1e-5, atol=0)
        assert len(grads_ck) == len(grads)
        assert_all_close_to_reference(grads_ck, grads)  # summed in another order: within rounding of the largest
        assert trainer.hiddencut_stats() == plain.hiddencut_stats()


def _tiny_t5():
    config = transformers.T5Config(
        vocab_size=100, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, dropout_rate=0.3,
        decoder_start_token_id=0, attn_implementation="sdpa", initializer_factor=INIT_STD * 10,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def test_t5_with_sdpa_checkpointed_gives_the_same_loss_and_gradients(tmp_path):
    """T5's relative position bias, masked with sdpa's bool padding mask, enters the clean pass's ranking:
    made with the gradient, the masked bias saved a tensor for a backward in the forward that the
    recompute (which ranks nothing) did not, and torch refused the recompute (CheckpointError)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:], mask[2, 3:] = 0, 0
    batch = {
        "input_ids": torch.randint(3, 100, (3, 8), generator=g).masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": torch.randint(3, 100, (3, 5), generator=g),
    }
    results = []
    for reentrant in (None, True, False):
        torch.manual_seed(0)
        model = _tiny_t5()
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        trainer = HiddenCutSeq2SeqTrainer(
            model=model, args=_args(tmp_path, seq2seq=True), hiddencut=HiddenCutConfig(alpha=ALPHA, ratio=0.5)
        )
        results.append(one_step(trainer, batch) + (trainer.hiddencut_stats(),))
    (loss, grads, stats), checkpointed = results[0], results[1:]
    assert stats["hiddencut_cut"] > 0
    # Stock T5's own gradients (no HiddenCut) differ under reentrant checkpointing by up to 2.4e-4 (its
    # backward sums in another order); non-reentrant, within the rounding of the largest term (gradients
    # reach 1e3 here, where a float32 ulp is 6e-5).
    for (loss_ck, grads_ck, stats_ck), reentrant in zip(checkpointed, (True, False)):
        torch.testing.assert_close(loss_ck, loss, rtol=1e-5, atol=0)
        assert len(grads_ck) == len(grads) and stats_ck == stats
        if reentrant:
            for a, b in zip(grads_ck, grads):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-4)
        else:
            assert_all_close_to_reference(grads_ck, grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_trained_with_hiddencut_still_pickles_as_its_own_classes(family, tmp_path):
    """torch.save of the whole model after a step (and deepcopy): the layers' plan-holding subclass is
    made at run time, so it pickles as the model's own class, and the cut hooks pickle too. The loaded
    model computes what the trained one does, and a copy is cut again by a trainer built on it."""
    build, make_batch, _, _ = FAMILIES[family]
    trainer = make_trainer(family, tmp_path, model=build(), ratio=0.5)
    batch = make_batch()
    one_step(trainer, batch)
    model = trainer.model.eval()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False).eval()
    layer_classes = {type(layer) for layer in hiddencut_layers(model)}
    assert all(not getattr(type(layer), "attn_reg_holds_plan", False) for layer in hiddencut_layers(loaded))
    assert {c.__mro__[1] for c in layer_classes} == {type(layer) for layer in hiddencut_layers(loaded)}
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
    copied = copy.deepcopy(model)
    again = make_trainer(family, tmp_path, model=copied, ratio=0.5)
    assert all(getattr(type(layer), "attn_reg_holds_plan", False) for layer in hiddencut_layers(copied))
    one_step(again, batch)
    assert again.hiddencut_stats()["hiddencut_cut"] > 0


def test_training_logs_the_counts_and_evaluation_is_one_uncut_pass(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=4, logging_steps=2, max_steps=4, learning_rate=1e-3)
    args.report_to = ["tensorboard"]
    trainer = HiddenCutTrainer(
        model=tiny_bert(), args=args, train_dataset=classifier_rows(16, 0), eval_dataset=classifier_rows(4, 1),
        data_collator=torch.utils.data.default_collate, hiddencut=HiddenCutConfig(layers="1"),
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # 2 steps a log, 4 rows of 6 tokens, one layer: 8 spans of floor(0.6) -> 1 token over 48 real tokens
    assert len(logs) == 2 and all(h["hiddencut_cut"] == 8 and h["hiddencut_tokens"] == 48 for h in logs)
    assert all(h["hiddencut_js"] > 0 for h in logs)
    hf_tensorboard_matches_the_log(trainer, ["hiddencut_js", "hiddencut_cut", "hiddencut_tokens"])
    calls = []
    trainer.model.register_forward_hook(lambda m, a, kw, out: calls.append("hiddencut_plan" in kw), with_kwargs=True)
    metrics = trainer.evaluate()
    assert calls == [False] and "eval_hiddencut_cut" not in metrics


def test_refusals(tmp_path):
    with pytest.raises(TypeError, match=r"^hiddencut must be a HiddenCutConfig, got dict$"):
        HiddenCutTrainer(model=tiny_bert(), args=_args(tmp_path), hiddencut={"ratio": 0.1})
    with pytest.raises(ValueError, match=r"^HiddenCutConfig.ratio must be a fraction in \(0, 1\], got 2$"):
        HiddenCutTrainer(model=tiny_bert(), args=_args(tmp_path), hiddencut=HiddenCutConfig(ratio=2))
    with pytest.raises(ValueError, match=r"^HiddenCutConfig.layers: the model has 2 layers \(0-1\), got 2$"):
        HiddenCutTrainer(model=tiny_bert(), args=_args(tmp_path), hiddencut=HiddenCutConfig(layers="2"))
    flex = tiny_bert()
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(
        ValueError, match=r"'eager' or 'sdpa' attention; this model uses 'flex_attention': load it with"
    ):
        HiddenCutTrainer(model=flex, args=_args(tmp_path), hiddencut=HiddenCutConfig())

    class Both(HiddenCutTrainerMixin, RDropTrainerMixin, transformers.Trainer):
        pass

    with pytest.raises(ValueError) as e:
        Both(model=tiny_bert(), args=_args(tmp_path), hiddencut=HiddenCutConfig(), rdrop=RDropConfig())
    assert str(e.value).startswith(
        "R-Drop (rdrop=RDropConfig) and HiddenCut (hiddencut=HiddenCutConfig) do not combine in one run"
    )


def test_two_gloo_ranks_without_find_unused_parameters(tmp_path):
    ranks = torchrun_ranks("hiddencut_rank.py", tmp_path, timeout=300)
    assert all(r["world_size"] == 2 and r["find_unused_parameters"] is False for r in ranks)
    params = [r["params"] for r in ranks]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert any(not torch.equal(params[0][k], ranks[0]["initial"][k]) for k in params[0])  # it trained
    logs = [h for h in ranks[0]["log_history"] if "loss" in h]
    assert len(logs) == 3 and all(h["hiddencut_js"] > 0 for h in logs)
    # the logged counts are the whole job's: both ranks' own counts added
    for step, log in enumerate(logs):
        (c0, t0), (c1, t1) = ranks[0]["local"][step], ranks[1]["local"][step]
        assert c0 > 0 and c1 > 0 and t0 > 0 and t1 > 0
        assert log["hiddencut_cut"] == c0 + c1 and log["hiddencut_tokens"] == t0 + t1


def _with_attention_dropout(model, p):
    """Attention dropout ``p`` in every attention module, wherever the family keeps its rate (read per call)."""
    for module in model.modules():
        if not any(hasattr(module, k) for k in ("k_proj", "key")):
            continue
        if isinstance(getattr(module, "dropout", None), torch.nn.Dropout):  # BERT
            module.dropout.p = p
        for name in ("attention_dropout", "dropout"):  # Llama, Marian
            if isinstance(module.__dict__.get(name), float):
                setattr(module, name, p)
    return model


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_clean_pass_ranks_the_softmax_before_dropout_and_its_output_is_the_stock_attentions(
    family, implementation, tmp_path
):
    _ranked_twin_against_stock(family, implementation, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_the_clean_pass_ranks_the_softmax_before_dropout_and_its_output_is_the_stock_attentions(
    family, implementation, tmp_path
):
    _ranked_twin_against_stock(family, implementation, tmp_path, "cuda")


def _ranked_twin_against_stock(family, implementation, tmp_path, device):
    """The model's outputs through the ranked twin are its own attention's, to the bit, the dropout draws
    included, with or without a ranking; the ranking is attention_received of eager's maps without dropout
    (as the official code's ori_attention_probs), made block by block."""
    build, make_batch, _, _ = FAMILIES[family]
    batch = {k: v.to(device) for k, v in make_batch().items()}
    model = build(dropout=0.0).to(device)
    model.set_attn_implementation(implementation)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    reference.eval()
    maps = reference(**batch, output_attentions=True)
    maps = maps.encoder_attentions if family == "marian" else maps.attentions
    trainer = make_trainer(family, tmp_path, model=model)
    model.to(device)  # the trainer's arguments say CPU; the ranking works where the model is
    assert model.config._attn_implementation == RANKED[implementation]
    valid = batch.get("attention_mask", torch.ones(batch["input_ids"].shape, device=device)).bool()

    _with_attention_dropout(model, 0.5).train()
    _with_attention_dropout(reference, 0.5).train()
    reference.set_attn_implementation(implementation)
    torch.manual_seed(3)
    stock = reference(**batch)
    ranking = Ranking(trainer._hiddencut_ranked, valid)
    torch.manual_seed(3)
    clean = model(**batch, **{RANKING_KWARG: ranking})
    assert torch.equal(clean.logits, stock.logits) and torch.equal(clean.loss, stock.loss)
    torch.manual_seed(3)
    assert torch.equal(model(**batch).logits, stock.logits)
    received = ranking.close()
    assert sorted(received) == list(range(len(maps)))
    # layer 0's input is the embeddings (no dropout in them here): its ranking is the eval maps' to float noise
    torch.testing.assert_close(received[0], core.attention_received(maps[0], valid), rtol=1e-5, atol=1e-6)
    assert (received[1] - core.attention_received(maps[1], valid)).abs().max() > 1e-4  # attention dropout before it
    assert torch.all(received[0][~valid] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_a_step_in_each_precision_is_finite_and_repeats_with_the_seed(family, precision, tmp_path):
    """A whole HiddenCut step on the GPU through sdpa's ranked twin, under the Trainer's autocast: a finite
    loss and gradients, and the same seed gives the same loss and gradients."""
    build, make_batch, seq2seq, _ = FAMILIES[family]
    model = build()
    model.set_attn_implementation("sdpa")
    args = _args(tmp_path, seq2seq, use_cpu=False, bf16=precision == "bf16", fp16=precision == "fp16")
    cls = HiddenCutSeq2SeqTrainer if seq2seq else HiddenCutTrainer
    trainer = cls(model=model, args=args, hiddencut=HiddenCutConfig(alpha=ALPHA))
    assert next(model.parameters()).device.type == "cuda"
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        steps.append(one_step(trainer, make_batch()))
    for loss, grads in steps:
        assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(steps[0][0], steps[1][0])
    assert all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1]))


def test_a_recompute_of_the_clean_pass_ranks_nothing_again():
    layer = torch.nn.Linear(2, 2)
    ranking = Ranking({0: layer}, torch.ones(1, 3, dtype=torch.bool))
    q = torch.randn(1, 2, 3, 4)
    ranking.record(layer, q, q, None, {}, eager=True)
    first = ranking.received[0]
    ranking.record(layer, q * 2, q * 2, None, {}, eager=True)  # a second call of the layer: the first counts
    assert ranking.close()[0] is first
    ranking.record(layer, q, q, None, {}, eager=True)
    ranking.received.clear()
    ranking.record(layer, q, q, None, {}, eager=True)  # closed: a checkpoint's recompute adds nothing
    assert ranking.received == {}


def test_a_layer_whose_attention_bypasses_the_ranking_is_named_at_the_first_step(tmp_path):
    """BERT's layer 1 is given a config of its own that keeps plain eager attention, so only layer 0's
    call is ranked: the step is refused, naming layer 1, before anything is cut or trained."""
    trainer = make_trainer("bert", tmp_path)
    attention = trainer.model.bert.encoder.layer[1].attention.self
    attention.config = copy.copy(attention.config)
    attention.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"HiddenCut: layers \[1\] of BertForSequenceClassification made no attention"):
        one_step(trainer, bert_batch())


def test_gpt2_reordered_upcast_attention_is_refused_naming_the_fix(tmp_path):
    """GPT-2's reorder_and_upcast_attn path bypasses the AttentionInterface, where the ranking is made."""
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=50, n_positions=16, reorder_and_upcast_attn=True
    )
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="reorder_and_upcast_attn=True.*set reorder_and_upcast_attn=False"):
        HiddenCutTrainer(model=model, args=_args(tmp_path), hiddencut=HiddenCutConfig())


def test_a_model_without_an_attention_mask_ranks_every_position(tmp_path):
    """A ViT classifier: no attention_mask and no input_ids; every patch and the CLS token are real."""
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=2, attn_implementation="sdpa",
    )  # fmt: skip
    trainer = HiddenCutTrainer(
        model=transformers.ViTForImageClassification(config), args=_args(tmp_path), hiddencut=HiddenCutConfig()
    )
    batch = {
        "pixel_values": torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)),
        "labels": torch.tensor([0, 1, 1]),
    }
    loss, grads = one_step(trainer, batch)
    assert torch.isfinite(loss) and grads
    assert (
        int(trainer.own_pass_sums["hiddencut_tokens"]) == 2 * 3 * 5
        and int(trainer.own_pass_sums["hiddencut_cut"]) == 2 * 3 * 1
    )  # layers x images x (4 + CLS)


def test_soft_capped_attention_is_ranked_as_its_eager_maps(tmp_path):
    """Gemma-2's eager attention caps its logits (softcap * tanh(scores / softcap)) and slides a window
    over alternate layers: the ranking made block by block is attention_received of its own maps (at a cap
    of 0.5 the maps without it differ far beyond the tolerance)."""
    config = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=100, attn_logit_softcapping=0.5, sliding_window=4, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config).eval()
    batch = llama_batch()
    maps = copy.deepcopy(model)(**batch, output_attentions=True).attentions
    trainer = HiddenCutTrainer(model=model, args=_args(tmp_path), hiddencut=HiddenCutConfig())
    ranking = Ranking(trainer._hiddencut_ranked, None)
    model(**batch, **{RANKING_KWARG: ranking})
    received = ranking.close()
    valid = torch.ones(batch["input_ids"].shape, dtype=torch.bool)
    for index, weights in enumerate(maps):
        torch.testing.assert_close(received[index], core.attention_received(weights, valid), rtol=1e-5, atol=1e-6)
