"""Every supported Hugging Face family (tests/families.py), on its tiny random config.

Per family: the sites found by watching the calls have the family's kinds and depths; with
nothing active the outputs equal stock sdpa (with padding, and causal masks where the family
has them); gradient attribution through the adapter equals autograd on eager attention maps;
one AD-DROP step drops about p*q of the real keys and never a padding or future key.
"""

import copy
import functools

import pytest
import torch
import transformers
from families import FAMILIES, REFUSED, build, families_table

from attn_reg_plugin.core.kernel import blockwise
from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.controller import RegularizationController
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout.game import AttendOut as AttendOutGame
from attn_reg_plugin.core.regularizers.attribution import token_loss_target
from attn_reg_plugin.hf import install_attention_sites
from helpers import REPO, run_in_blocks

PADDED = 3  # the second row's last PADDED encoder (or causal-LM) tokens are padding


@functools.cache
def _built(name):
    return build(next(f for f in FAMILIES if f.name == name))


def _model(family):
    """A fresh copy of the family's tiny model (built once per session: building dominates these tests)."""
    return copy.deepcopy(_built(family.name))


def _inputs(family, model):
    g = torch.Generator().manual_seed(1)
    if family.head == "SpeechSeq2Seq":
        frames = 2 * model.config.max_source_positions
        return {
            "input_features": torch.randn(2, model.config.num_mel_bins, frames, generator=g),
            "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g),
        }
    ids = torch.randint(3, 99, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -PADDED:] = 0
    inputs = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    if family.head == "Seq2SeqLM":
        inputs["decoder_input_ids"] = torch.randint(3, 99, (2, 5), generator=g)
    return inputs


def _keep(family, inputs, logits):
    """Which output positions the token target counts: real tokens (encoders, causal LMs), every decoder token."""
    if family.head in ("MaskedLM", "CausalLM"):
        return inputs["attention_mask"].bool()
    return torch.ones(logits.shape[:2], dtype=torch.bool)


def _adapted(model):
    ours = copy.deepcopy(model)
    controller = RegularizationController()
    sites = install_attention_sites(ours, controller)
    return ours, controller, sites


def _layers(family, model):
    c = model.config
    for name in ("num_hidden_layers", "n_layers", "n_layer", "num_layers", "encoder_layers"):
        if getattr(c, name, None):
            return getattr(c, name)
    raise AssertionError(family.name)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sites_have_the_family_kinds_and_depths(family):
    model = _model(family)
    _, controller, sites = _adapted(model)
    depth = _layers(family, model)
    assert {s.kind for _, s in sites} == set(family.kinds)
    for kind in family.kinds:
        assert [s.layer for _, s in sites if s.kind == kind] == list(range(depth)), kind


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_idle_equals_stock_sdpa_and_a_noop_hook_is_the_kernel(family):
    stock = _model(family).eval()
    ours, controller, _ = _adapted(stock)
    ours.eval()
    inputs = _inputs(family, stock)
    with torch.no_grad():
        expected = stock(**inputs).logits
        assert torch.equal(ours(**inputs).logits, expected)
        with controller.hooks({s: EditScores() for s in controller.sites}):
            hooked = ours(**inputs).logits
    real = _keep(family, inputs, expected)
    torch.testing.assert_close(hooked[real], expected[real], rtol=1e-4, atol=1e-5)


def _eager_maps(family, out):
    if family.head in ("MaskedLM", "CausalLM"):
        kind = family.kinds[0]
        return {(kind, i): a for i, a in enumerate(out.attentions)}
    maps = {}
    for kind, maps_of_kind in (
        ("encoder-self", out.encoder_attentions),
        ("decoder-self", out.decoder_attentions),
        ("encoder-decoder", out.cross_attentions),
    ):
        maps.update({(kind, i): a for i, a in enumerate(maps_of_kind)})
    return maps


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_gradient_attribution_equals_autograd_on_eager_maps(family):
    stock = _model(family).eval()
    inputs = _inputs(family, stock)
    eager = copy.deepcopy(stock)
    eager.set_attn_implementation("eager")
    out = eager(**inputs, output_attentions=True)
    keep = _keep(family, inputs, out.logits)
    value, labels = token_loss_target(out.logits, keep)
    maps = _eager_maps(family, out)
    expected = dict(zip(maps, torch.autograd.grad(value, list(maps.values()))))

    ours, controller, _ = _adapted(stock)
    ours.eval()
    ad = ADDrop(ADDropConfig(attention=",".join(family.kinds)), controller)
    sites, attributions, _ = ad.attributions(
        lambda: ours(**inputs), lambda o, y: token_loss_target(o.logits, keep, y), frozen=ours
    )
    assert sorted((s.kind, s.layer) for s in sites) == sorted(expected)
    for site, got in zip(sites, attributions):
        want = expected[(site.kind, site.layer)]
        # atol: float32 sums that cancel to ~1e-3 differ by ~1e-6 between one and two torch threads (mT5)
        torch.testing.assert_close(got.expand_as(want), want, rtol=1e-4, atol=5e-6)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_one_ad_drop_step_drops_about_pq_and_no_padding_or_future_key(family, monkeypatch):
    model = _model(family)
    model.train()  # model dropout stays on: the rate is counted over the kernel's masks only
    ours, controller, _ = _adapted(model)
    inputs = _inputs(family, model)
    drops = []
    real_rule_drops = blockwise.rule_drops

    def recording(*args):  # each one-block call's drops, as its mask takes them
        made = real_rule_drops(*args)
        drops.append(made[0])
        return made

    monkeypatch.setattr(blockwise, "rule_drops", recording)
    p = q = 0.5
    ad = ADDrop(ADDropConfig(p=p, q=q, attention=",".join(family.kinds), schedule="always"), controller)
    with torch.no_grad():
        keep = _keep(family, inputs, model(**inputs).logits)

    def target(o, y):
        return token_loss_target(o.logits, keep, y)

    torch.manual_seed(0)
    with ad.masked(lambda: ours(**inputs), target, frozen=ours) as stats:
        logits = ours(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits[keep], logits[keep].argmax(-1))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    rate = float(stats["dropped"]) / float(stats["droppable"])
    assert 0.6 * p * q < rate < 1.6 * p * q, rate
    assert len(drops) == len(ad.sites)
    for site, drop in zip(ad.sites, drops):
        if "attention_mask" in inputs and site.kind in ("encoder-self", "encoder-decoder") or family.head == "CausalLM":
            assert not drop[1, ..., -PADDED:].any(), (site.kind, site.layer)  # padding keys of the padded row
        if site.kind == "decoder-self":
            t, s = drop.shape[-2:]
            future = torch.ones(t, s, dtype=torch.bool).triu(1 + s - t)
            assert not (drop & future).any(), site.layer


def test_deberta_is_refused_with_the_reason():
    import transformers

    config = transformers.AutoConfig.for_model(
        "deberta-v2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99
    )
    model = transformers.AutoModelForMaskedLM.from_config(config)
    with pytest.raises(ValueError, match="disentangled attention does not go through transformers' AttentionInterface"):
        install_attention_sites(model, RegularizationController())


def test_the_hf_docs_table_is_generated_from_the_families_and_the_readme_names_them():
    doc = (REPO / "docs" / "HF.md").read_text(encoding="utf-8")
    assert "<!-- supported models -->\n" + families_table() + "\n\n" in doc
    assert all(f"| {name} |" in doc for name in [f.name for f in FAMILIES] + list(REFUSED))
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    named = readme[
        readme.index("## Quick start: Hugging Face Trainer") : readme.index("## Quick start: your own model")
    ]
    assert f"{len(FAMILIES)} families are tested" in named.replace("\n", " ").replace("Nineteen", "19")


def test_causal_lm_target_scores_each_label_with_the_previous_position():
    """A causal LM's logits at t predict token t + 1 (its loss shifts): the AD-DROP target does too."""
    import transformers

    from attn_reg_plugin.hf import ADDropTrainer

    family = next(f for f in FAMILIES if f.model_type == "llama")
    model = build(family)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt: no loss on it
    args = transformers.TrainingArguments(output_dir="/tmp/unused", use_cpu=True, report_to=[])
    trainer = ADDropTrainer(model=model, args=args, train_dataset=[], ad_drop=ADDropConfig(labels="gold"))
    out = model(input_ids=ids)
    value, used = trainer.ad_drop_target(model, {"input_ids": ids, "labels": labels})(out, None)
    assert torch.equal(used, labels[:, 1:].masked_fill(labels[:, 1:] == -100, 0))
    keep = labels[:, 1:] != -100
    direct, _ = token_loss_target(out.logits[:, :-1], keep, labels[:, 1:].masked_fill(~keep, 0))
    torch.testing.assert_close(value, direct)
    assert not torch.allclose(
        value, token_loss_target(out.logits, labels != -100, labels.masked_fill(labels == -100, 0))[0]
    )


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_attribution_and_the_no_extra_cost_regularizers_train(family):
    """IGA, AA and RD steps, scheduled attention dropout and attention LayerDrop on each family:
    finite losses and gradients, and each one changes the training forward."""
    from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDrop, AttentionLayerDropConfig
    from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledAttentionDropout, ScheduledDropoutConfig

    model = _model(family)
    ours, controller, _ = _adapted(model)
    ours.eval()  # model dropout off: any change below comes from the regularizer
    inputs = _inputs(family, model)
    kinds = ",".join(family.kinds)
    with torch.no_grad():
        plain = ours(**inputs).logits
    keep = _keep(family, inputs, plain)

    def step(forward):
        ours.zero_grad(set_to_none=True)
        logits = forward()
        loss = torch.nn.functional.cross_entropy(logits[keep], plain[keep].argmax(-1))
        loss.backward()
        assert torch.isfinite(loss) and all(
            torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None
        )
        return logits.detach()

    for attribution in ("iga", "aa", "rd"):
        ad = ADDrop(
            ADDropConfig(p=0.5, q=0.5, attention=kinds, attribution=attribution, iga_steps=2, schedule="always"),
            controller,
        )
        with ad.masked(lambda: ours(**inputs), lambda o, y: token_loss_target(o.logits, keep, y), frozen=ours) as stats:
            logits = step(lambda: ours(**inputs).logits)
        assert float(stats["dropped"]) > 0 and not torch.allclose(logits, plain), attribution
    sched = ScheduledAttentionDropout(ScheduledDropoutConfig(schedule="0:0.5", attention=kinds), controller)
    with controller.hooks(sched.hooks(update=0)):
        assert not torch.allclose(step(lambda: ours(**inputs).logits), plain)
    layerdrop = AttentionLayerDrop(AttentionLayerDropConfig(p=1.0, attention=kinds), controller)
    with controller.hooks(layerdrop.hooks()) as record:
        assert not torch.allclose(step(lambda: ours(**inputs).logits), plain)
    calls = record.calls()
    # counted by the kernel: every selected layer was called and skipped
    assert [int(c) for c in calls] == [len(layerdrop.sites)] * 2


def test_two_controllers_on_one_model_drive_the_same_sites():
    """A second install on a model registers the sites its modules hold with the second controller:
    either controller's pass reaches the model, no claim needed (the benchmark's trainers share a
    model). A copy of an installed model gets sites of its own."""
    from attn_reg_plugin.hf.sites import installed_sites

    model = build(FAMILIES[0])
    first, second = RegularizationController(), RegularizationController()
    first_sites = install_attention_sites(model, first)
    second_sites = install_attention_sites(model, second)
    assert second_sites == first_sites == installed_sites(model) and first.sites == second.sites

    def valid_positions_seen(controller):
        keep_all = EditScores(drop=torch.zeros((1, 1, 1, 1), dtype=torch.bool), counted=True)
        with controller.hooks({s: keep_all for s in controller.sites}) as record:
            model(input_ids=torch.tensor([[5, 6, 7]]))
        return float(record.counts()[1])  # dropped, valid: filled by the sites that are called

    assert valid_positions_seen(first) == valid_positions_seen(second) == 2 * 4 * 3 * 3  # 2 layers x 4 heads x 3 x 3
    copied = install_attention_sites(copy.deepcopy(model), RegularizationController())
    assert [p for p, _ in copied] == [p for p, _ in first_sites]
    assert not {id(s) for _, s in copied} & {id(s) for _, s in first_sites}


def _attendout_rows(family, model, n=4):
    """Training rows with labels as the family's own loss reads them (tokens, or decoder tokens)."""
    rows = []
    for i in range(n):
        inputs = {k: v[i % 2] for k, v in _inputs(family, model).items()}
        if family.head in ("MaskedLM", "CausalLM"):
            inputs["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        else:
            inputs["labels"] = inputs.pop("decoder_input_ids")
        rows.append(inputs)
    return rows


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_attendout_trains_on_every_family(family, tmp_path):
    """One update ending a dropout step: the Attacker's masks drop keys of every selected kind
    (Whisper: decoder-self, its encoder reads features), REINFORCE moves the Generator, the
    survivor's weights end up in both networks, and the held-out losses are finite."""
    import transformers

    from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
    from attn_reg_plugin.hf import AttendOutSeq2SeqTrainer, AttendOutTrainer

    model = _model(family)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = 0
    kinds = "decoder-self" if family.head == "SpeechSeq2Seq" else ",".join(family.kinds)
    seq2seq = family.head in ("Seq2SeqLM", "SpeechSeq2Seq")
    rows = _attendout_rows(family, model)
    args = (transformers.Seq2SeqTrainingArguments if seq2seq else transformers.TrainingArguments)(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        seed=3,
    )
    trainer = (AttendOutSeq2SeqTrainer if seq2seq else AttendOutTrainer)(
        model=model,
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=_stack,
        attendout=AttendOutConfig(dropout_step=1, attention=kinds, init_drop=0.3),
    )
    generator_before = [p.detach().clone() for p in trainer.attendout_generator.parameters()]
    drops = []
    real_hooks = AttendOutGame.attacker_hooks

    def counted(self, streams):
        hooks = real_hooks(self, streams)
        drops.append({site.kind: int(hook.drop.dense().sum()) for site, hook in hooks.items()})
        return hooks

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AttendOutGame, "attacker_hooks", counted)
        trainer.train()
    history = trainer.state.log_history
    assert [h["attendout_dropout_step"] for h in history if "attendout_dropout_step" in h] == [1]
    losses = [h["attendout_attacker_loss"] for h in history if "attendout_attacker_loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert drops and all(set(d) == set(kinds.split(",")) and all(v > 0 for v in d.values()) for d in drops)
    assert any(not torch.equal(a, b) for a, b in zip(generator_before, trainer.attendout_generator.parameters()))
    for d, a in zip(trainer.model.parameters(), trainer.attendout_attacker.parameters()):
        assert torch.equal(d, a)  # re-synced at the end of the dropout step
    # Held-out losses score what the model's own loss scores (a causal LM: logits t against label t + 1).
    batch = _stack(rows[:2])
    model.eval()
    with torch.no_grad():
        logits, labels, _ = trainer._attendout_logits(model, batch)
        own = model(**batch).loss
    torch.testing.assert_close(torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten()), own)


def _stack(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def test_attendout_on_whisper_encoder_is_refused_at_the_first_batch(tmp_path):
    import transformers

    from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
    from attn_reg_plugin.hf import AttendOutSeq2SeqTrainer

    family = next(f for f in FAMILIES if f.name == "Whisper")
    model = _model(family)
    rows = _attendout_rows(family, model)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="no",
        remove_unused_columns=False,
    )
    trainer = AttendOutSeq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=_stack,
        attendout=AttendOutConfig(dropout_step=1),
    )  # auto: encoder-self
    with pytest.raises(
        ValueError,
        match=r"needs input_ids in every training batch: the generator reads the tokens "
        r"\(this model's encoder reads features, so only --attention decoder-self",
    ):
        trainer.train()


def test_a_shared_attention_module_is_refused_under_activation_checkpointing():
    """ALBERT calls one attention module at every depth; its calls are numbered from 0 by each forward,
    which a recompute in the backward would not be: under gradient checkpointing the forward says so
    (ALBERT itself refuses gradient_checkpointing_enable; a model that allowed it would get this)."""
    family = next(f for f in FAMILIES if f.name == "ALBERT")
    model = build(family)
    install_attention_sites(model, RegularizationController())
    ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=ids)  # no checkpointing: runs
    model.albert.encoder.gradient_checkpointing = True
    with pytest.raises(NotImplementedError, match="shared layers.*without gradient checkpointing"):
        model(input_ids=ids)


def test_multi_head_latent_attention_trains_block_by_block(tmp_path, monkeypatch):
    """DeepSeek-V3's attention has value heads (16) wider than its query and key heads (12): an AD-DROP
    step whose calls run block by block (as past 128 keys) trains, the value heads taking sdpa's math path."""
    from attn_reg_plugin.hf import ADDropTrainer

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=16, vocab_size=100, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    run_in_blocks(monkeypatch)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", remove_unused_columns=False
    )
    trainer = ADDropTrainer(model=model, args=args, ad_drop=ADDropConfig(p=0.3, q=0.3, schedule="always"))
    ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(1))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); one step is taken here by hand
    loss = trainer.training_step(trainer.model, {"input_ids": ids, "labels": ids})
    assert torch.isfinite(loss) and int(trainer._ad_drop_dropped) > 0
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
