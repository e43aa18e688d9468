"""The plugin's fairseq attention: identical to MultiheadAttention unless a regularizer acts."""

import copy

import pytest
import torch

from attn_reg_plugin.core.kernel.attention_call import Plan, passing

fairseq = pytest.importorskip("fairseq")
from fairseq.modules.multihead_attention import MultiheadAttention  # noqa: E402

from attn_reg_plugin.core.kernel.attention_call import EditScores  # noqa: E402
from attn_reg_plugin.core.kernel.controller import RegularizationController  # noqa: E402
from attn_reg_plugin.fairseq_plugin.attention import RegularizedMultiheadAttention, install_attention_sites  # noqa: E402
from helpers import TINY_TRANSFORMER, fairseq_setup  # noqa: E402


def _pair(**kwargs):
    torch.manual_seed(0)
    stock = MultiheadAttention(16, 4, **kwargs)
    ours = copy.deepcopy(stock)
    ours.__class__ = RegularizedMultiheadAttention
    ours.attn_reg_site = RegularizationController().register("encoder-self", 0)
    return stock, ours


def _inputs(T=5, S=7, B=3):
    g = torch.Generator().manual_seed(1)
    query = torch.randn(T, B, 16, generator=g)
    kv = torch.randn(S, B, 16, generator=g)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, :2] = True  # left padding, as fairseq pads sources
    kpm[2, -1] = True
    return query, kv, kpm


def _pass(module, hook):
    """A pass built by hand asking ``hook`` of ``module``'s site, in progress for the block."""
    return passing(Plan.asking({module.attn_reg_site: hook}))


@pytest.mark.parametrize("training", [True, False])
def test_self_attention_regularized_path_matches_stock(training):
    stock, ours = _pair(self_attention=True)
    stock.train(training), ours.train(training)
    x, _, _ = _inputs(T=6, S=6)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[0, -2:] = True  # right padding, as fairseq pads targets (no query row loses every key)
    causal = torch.triu(torch.full((6, 6), float("-inf")), 1)
    for attn_mask in (None, causal):
        ref, _ = stock(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
        idle, _ = ours(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
        assert torch.equal(idle, ref)  # no hook: fairseq's own code path, bit-identical
        with _pass(ours, EditScores()):  # our kernel, nothing dropped
            got, _ = ours(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_encoder_decoder_attention_and_weights_match_stock():
    stock, ours = _pair(kdim=16, vdim=16, encoder_decoder_attention=True)
    stock.train(), ours.train()
    q, kv, kpm = _inputs()
    ref, ref_w = stock(q, kv, kv, key_padding_mask=kpm, static_kv=True, need_weights=True)
    ref_h, ref_hw = stock(q, kv, kv, key_padding_mask=kpm, static_kv=True, need_head_weights=True)
    with _pass(ours, EditScores()):
        got, got_w = ours(q, kv, kv, key_padding_mask=kpm, static_kv=True, need_weights=True)
        got_h, got_hw = ours(q, kv, kv, key_padding_mask=kpm, static_kv=True, need_head_weights=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_hw, ref_hw, rtol=1e-5, atol=1e-6)
    assert got_hw.shape == ref_hw.shape and got_hw.dim() == 4  # per head: (heads, B, T, S)


def test_dropped_key_gets_zero_weight_in_fairseq_module():
    _, ours = _pair(kdim=16, vdim=16, encoder_decoder_attention=True)
    ours.eval()
    q, kv, kpm = _inputs()
    drop = torch.zeros(3, 1, 5, 7, dtype=torch.bool)
    drop[0, :, :, 4] = True
    with _pass(ours, EditScores(drop=drop)):
        _, w = ours(q, kv, kv, key_padding_mask=kpm, static_kv=True, need_head_weights=True)
    assert torch.all(w[:, 0, :, 4] == 0)
    assert torch.all(w[:, 1, :, :2] == 0)  # padding still masked
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))


def test_install_registers_sites_without_new_parameters(tiny_mt_data):
    cfg, task, model, _ = fairseq_setup(tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER])
    controller = task.attn_reg_controller
    kinds = [(s.kind, s.layer) for s in controller.sites]
    assert sorted(kinds) == sorted(
        [
            ("encoder-self", 0),
            ("encoder-self", 1),
            ("decoder-self", 0),
            ("decoder-self", 1),
            ("encoder-decoder", 0),
            ("encoder-decoder", 1),
        ]
    )
    mods = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    assert mods and all(type(m) is RegularizedMultiheadAttention for m in mods)
    # The state dict is a plain fairseq TransformerModel's: same keys, nothing added.
    from fairseq.tasks.translation import TranslationTask

    plain = TranslationTask.setup_task(cfg.task).build_model(cfg.model)
    assert set(model.state_dict()) == set(plain.state_dict())


def test_whole_model_no_op_hooks_match_stock_forward(tiny_mt_data):
    """Routing every attention through the kernel (nothing dropped) leaves the model's output unchanged."""
    _, task, model, _ = fairseq_setup(
        tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER, "--dropout", "0"]
    )
    model.train()
    task.load_dataset("valid")
    batch = next(iter(task.get_batch_iterator(task.dataset("valid"), max_tokens=400).next_epoch_itr(shuffle=False)))
    ref = model(**batch["net_input"])[0]
    controller = task.attn_reg_controller
    with controller.hooks({s: EditScores() for s in controller.sites}):
        got = model(**batch["net_input"])[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_install_on_encoder_only_model_and_missing_decoder_error():
    """A model without a decoder has only encoder-self sites; asking for encoder-decoder fails clearly."""
    from argparse import Namespace

    from fairseq.data import Dictionary
    from fairseq.models.roberta.model import RobertaEncoder, base_architecture

    args = Namespace(
        encoder_layers=2,
        encoder_embed_dim=16,
        encoder_ffn_embed_dim=32,
        encoder_attention_heads=2,
        max_positions=32,
        untie_weights_roberta=False,
    )
    base_architecture(args)
    d = Dictionary()
    for w in "a b c".split():
        d.add_symbol(w)
    encoder = RobertaEncoder(args, d)
    controller = install_attention_sites(encoder, RegularizationController())
    assert [(s.kind, s.layer) for s in controller.sites] == [("encoder-self", 0), ("encoder-self", 1)]
    from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig

    with pytest.raises(ValueError, match="encoder-decoder.*no such attention"):
        ADDrop(ADDropConfig(attention="encoder-decoder"), controller)


def test_torchscript_is_refused_clearly_and_plain_attention_scripts(tiny_mt_data):
    """torch.jit.script of a routed model says why it cannot and what to do, without touching the model;
    after plain_fairseq_attention the same model scripts and computes the same output."""
    from attn_reg_plugin.fairseq_plugin.attention import plain_fairseq_attention

    _, task, model, _ = fairseq_setup(tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER])
    model.eval()
    with pytest.raises(RuntimeError, match="TorchScript cannot compile.*plain_fairseq_attention"):
        torch.jit.script(model)
    assert all(type(m) is RegularizedMultiheadAttention for m in model.modules() if isinstance(m, MultiheadAttention))
    src = torch.tensor([[5, 6, 7, 2]])
    prev = torch.tensor([[2, 8, 9]])
    ref = model(src, torch.tensor([4]), prev)[0]
    plain_fairseq_attention(model)
    assert all(type(m) is MultiheadAttention for m in model.modules() if isinstance(m, MultiheadAttention))
    scripted = torch.jit.script(model)
    torch.testing.assert_close(scripted(src, torch.tensor([4]), prev)[0], ref)
