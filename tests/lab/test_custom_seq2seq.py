"""examples/custom_seq2seq: the porting API in a plain-PyTorch model, and its training CLI."""

import json
import math
import subprocess
import sys

import pytest
import torch

from attn_reg_plugin.core import RegularizationController
from attn_reg_plugin.core.kernel.attention_call import EditScores, hook_in_progress
from helpers import REPO, load_script, run_in_blocks

EXAMPLE = REPO / "examples" / "custom_seq2seq"


model_mod = load_script(EXAMPLE / "seq2seq_model.py", "seq2seq_model")
sys.modules["seq2seq_model"] = model_mod  # train.py imports its neighbour as a script would
train_mod = load_script(EXAMPLE / "train.py", "custom_seq2seq_train")


def test_core_api_is_framework_free():
    """The porting API imports neither fairseq nor transformers."""
    code = (
        "import sys; from attn_reg_plugin.core import attend, RegularizationController, ADDrop, ADDropConfig, "
        "ad_drop_epoch, token_loss_target, logit_target, regression_target; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'fairseq', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _reference_pair(heads=4, dim=16, dropout=0.0):
    torch.manual_seed(0)
    site = RegularizationController().register("encoder-self", 0)
    ours = model_mod.MultiheadAttention(dim, heads, dropout, site).eval()
    ref = torch.nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ours, ref, site


def test_custom_attention_without_hook_equals_torch_reference():
    ours, ref, site = _reference_pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 16, generator=g)
    memory = torch.randn(3, 5, 16, generator=g)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2, 1:] = True
    with torch.no_grad():
        # cross-attention with key padding
        got = ours(x, memory, (~pad)[:, None, None, :])
        want, _ = ref(x, memory, memory, key_padding_mask=pad, need_weights=False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # causal self-attention with padding
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        self_pad = torch.zeros(3, 6, dtype=torch.bool)
        self_pad[1, 4:] = True
        got = ours(x, x, causal[None, None] & (~self_pad)[:, None, None, :])
        want, _ = ref(x, x, x, attn_mask=~causal, key_padding_mask=self_pad, need_weights=False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert hook_in_progress(site) is None


def test_custom_attention_drop_hook_removes_exactly_those_keys():
    """A drop mask asked of the site by a pass equals the reference attention with those keys masked
    out, through the controller's pass and through one built by hand as PORTING.md shows it."""
    from attn_reg_plugin.core.kernel.attention_call import Plan, Record, passing

    ours, ref, site = _reference_pair()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 16, generator=g)
    drop = torch.rand(2, 4, 5, 5, generator=g) < 0.3
    drop[..., 0] = False  # every row keeps a key
    allowed = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    with RegularizationController().hooks({site: EditScores(drop=drop)}):  # a pass trains: autograd on
        got = ours(x, x, allowed).detach()
    with torch.no_grad():
        want, _ = ref(x, x, x, attn_mask=drop.reshape(8, 5, 5), need_weights=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    record = Record()
    with passing(Plan.asking({ours.site: EditScores(drop=drop, counted=True)}, record)):
        by_hand = ours(x, x, allowed).detach()
    dropped, valid = record.counts()
    assert torch.equal(by_hand, got) and (int(dropped), int(valid)) == (int(drop.sum()), drop.numel())


def test_model_registers_one_site_per_attention():
    model = model_mod.Seq2SeqTransformer(50, 0, dim=16, heads=2, ffn_dim=32, encoder_layers=2, decoder_layers=3)
    kinds = [(s.kind, s.layer) for s in model.controller.sites]
    assert sorted(kinds) == sorted(
        [("encoder-self", 0), ("encoder-self", 1)]
        + [(k, i) for k in ("decoder-self", "encoder-decoder") for i in range(3)]
    )


TINY = [
    "--train-size",
    "48",
    "--valid-size",
    "12",
    "--bleu-sentences",
    "6",
    "--vocab-size",
    "150",
    "--dim",
    "32",
    "--heads",
    "2",
    "--ffn-dim",
    "64",
    "--layers",
    "2",
    "--batch-size",
    "12",
    "--warmup",
    "8",
    "--epochs",
    "2",
]


@pytest.mark.parametrize(
    "variant",
    [
        ["--norm", "pre", "--positions", "sinusoidal"],
        [
            "--norm",
            "post",
            "--positions",
            "learned",
            "--ad-drop-attention",
            "encoder-self,decoder-self,encoder-decoder",
        ],
    ],
)
def test_train_cli_plain_then_ad_drop_epoch(tmp_path, capsys, variant):
    p, q = 0.3, 0.3
    out = tmp_path / "run"
    assert train_mod.main([*TINY, *variant, "--ad-drop-p", str(p), "--ad-drop-q", str(q), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    first, second = result["epochs"]
    assert not first["ad_drop"] and first["drop_rate"] == 0
    assert second["ad_drop"] and 0.5 * p * q < second["drop_rate"] < p * q + 0.05, second
    assert all(math.isfinite(e["train_loss"]) and math.isfinite(e["valid_loss"]) for e in result["epochs"])
    assert f"drop rate {second['drop_rate']:.4f}" in printed and "| AD-DROP |" in printed and "| plain   |" in printed
    assert result["bleu_sentences"] == 6 and f"greedy BLEU on 6 test sentences: {result['bleu']:.2f}" in printed
    assert (out / "spm.model").stat().st_size > 0


def test_train_cli_plain_method_never_drops(tmp_path):
    result = train_mod.run(train_mod.parse_args([*TINY, "--method", "plain", "--bleu-sentences", "0"]))
    assert [e["ad_drop"] for e in result["epochs"]] == [False, False]
    assert all(e["drop_rate"] == 0 for e in result["epochs"]) and "bleu" not in result


def test_train_cli_rejects_bad_options_before_training(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--ad-drop-p must be in the open interval \(0, 1\), got 1.5"):
        train_mod.main([*TINY, "--ad-drop-p", "1.5"])
    with pytest.raises(ValueError, match=r"--ad-drop-layers: layer 4 does not exist.*0\.\.1"):
        train_mod.main([*TINY, "--ad-drop-layers", "4"])
    with pytest.raises(SystemExit):
        train_mod.main([*TINY, "--dim", "30", "--heads", "4"])
    captured = capsys.readouterr()
    assert "--dim 30 must be divisible by --heads 4" in captured.err
    assert "epoch" not in captured.out  # nothing trained
    with pytest.raises(SystemExit, match=r"--vocab-size 5 does not fit this data: .*[Vv]ocabulary size"):
        train_mod.main(
            [*TINY[: TINY.index("--vocab-size")], *TINY[TINY.index("--vocab-size") + 2 :], "--vocab-size", "5"]
        )
    assert "epoch" not in capsys.readouterr().out


def test_train_cli_rejects_non_parallel_data(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.en").write_text("one two\nthree four\n", encoding="utf-8")
        (tmp_path / f"{split}.ro").write_text("unu doi\ntrei patru\n", encoding="utf-8")
    (tmp_path / "valid.ro").write_text("unu doi\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"valid\.ro:2: empty sentence"):
        train_mod.main(["--data", str(tmp_path), "--epochs", "1"])
    (tmp_path / "valid.ro").write_text("unu doi\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"valid\.en has 2 lines but .*valid\.ro has 1"):
        train_mod.main(["--data", str(tmp_path), "--epochs", "1"])
    (tmp_path / "valid.ro").write_bytes(b"unu doi\ntrei \xff\n")
    with pytest.raises(ValueError, match=r"valid\.ro:2: not valid UTF-8"):
        train_mod.main(["--data", str(tmp_path), "--epochs", "1"])


@pytest.mark.parametrize("many_blocks", [False, True])
def test_a_ported_model_plays_attendout_on_every_kind_the_same_one_block_or_many(monkeypatch, many_blocks):
    """The custom seq2seq model (porting API) under AttendOut on encoder self-, decoder self- (causal,
    the Generator reading the target prefix) and encoder-decoder attention: the masks reach every
    kind, and the Attacker's loss and gradients, the rate and the Generator's update are the same
    whether the calls run as one block or many."""
    from attn_reg_plugin.core.regularizers.attendout import AttendOut, AttendOutConfig, Generator, build_attacker

    def game_step(many):
        with monkeypatch.context() as mp:
            if many:
                run_in_blocks(mp)
            torch.manual_seed(0)
            pad, vocab = 0, 40
            model = model_mod.Seq2SeqTransformer(
                vocab, pad, dim=16, heads=2, ffn_dim=32, encoder_layers=2, decoder_layers=2, dropout=0.0,
                attention_dropout=0.0,
            )  # fmt: skip
            attacker, controller = build_attacker(model, lambda copy, c: [c.add(s) for s in copy.controller.sites])
            generator = Generator({"source": vocab, "target": vocab}, {"source": pad, "target": pad}, 8, 160, 0.3, 1.0)
            kinds = "encoder-self,decoder-self,encoder-decoder"
            game = AttendOut(AttendOutConfig(dropout_step=1, attention=kinds, generator_dim=8), controller, generator)
            g = torch.Generator().manual_seed(1)
            src, tgt = torch.randint(3, vocab, (2, 150), generator=g), torch.randint(3, vocab, (2, 130), generator=g)
            src[1, -9:], tgt[1, -5:] = pad, pad
            prev = torch.cat([torch.full((2, 1), 2), tgt[:, :-1]], 1)
            with game.attacker_pass({"source": src, "target": prev}) as record:
                logits = attacker(src, prev)
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=pad)
            grads = torch.autograd.grad(loss, list(attacker.parameters()))
            per_call = [int(c.dropped) for _, c in record.entries]
            game.end_update()
            stats = game.finish_dropout_step(loss.detach().view(1), loss.detach().view(1) + 0.5)
            return loss, grads, per_call, stats, [p.detach().clone() for p in generator.parameters()]

    one, other = game_step(False), game_step(many_blocks)
    assert len(one[2]) == 6 and all(n > 0 for n in one[2])  # every site of every kind dropped units
    assert one[2] == other[2]
    torch.testing.assert_close(one[0], other[0])
    for a, b in zip(one[1], other[1]):
        torch.testing.assert_close(a, b)
    assert one[3]["drop_rate"] == other[3]["drop_rate"]
    for a, b in zip(one[4], other[4]):
        torch.testing.assert_close(a, b)
