"""The kernel under autocast: a regularized call runs in autocast's dtype, forward and backward, as
sdpa itself would, whether it is one block or many. The backward of the blockwise kernel runs
outside any autocast, so a kernel that leaned on autocast in its forward met other dtypes in its
backward (bf16=True crashed the HF Trainer at every length that runs block by block).

Each case runs a call with q and k in float32 and v in the autocast dtype (as a Llama under
autocast hands them over: the rotary embedding promotes q and k) under ``torch.autocast`` and
compares it with the same call on inputs cast by hand, autocast off: the same output, the same
gradients, each gradient in its input's dtype. The CUDA cases are ``make gpu-check``'s."""

import pytest
import torch

from attn_reg_plugin.core.kernel import blockwise, rules
from attn_reg_plugin.core.kernel.attention import attend
from attn_reg_plugin.core.kernel.attention_call import EditScores
from attn_reg_plugin.core.kernel.rules import (
    AttentionScores,
    BernoulliRule,
    GradientScores,
    IntegratedGradientScores,
    RandomScores,
    TopRegionRule,
)
from helpers import HandPass

B, H, T, D = 2, 2, 9, 4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _blocks(monkeypatch, split: bool):
    """Blocks of 2 query rows whatever the size (``split``), or every call one block."""
    if split:
        monkeypatch.setattr(rules, "CHUNK_ROWS", 2)
        monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1)
        monkeypatch.setattr(blockwise, "LINEAR_FACTOR", 0)
        monkeypatch.setattr(blockwise, "ONE_BLOCK_KEYS", 0)
    else:
        monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 1 << 40)


def _inputs(device):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device) for _ in range(3))
    # sample 1 is right-padded by 3 keys; a bool mask, True where a key may be attended
    valid = (torch.arange(T)[None, :] < torch.tensor([T, T - 3])[:, None]).to(device)[:, None, None, :]
    return q, k, v, valid


def _hook(kind, q, k, v, valid):
    """The hook of one regularizer's call, built from float32 tensors as a pass would keep them."""
    g = torch.Generator().manual_seed(7)
    grad_output = torch.randn(B, H, T, D, generator=g).to(q.device)
    scores = {
        "ga": lambda: GradientScores(grad_output, v),
        "aa": lambda: AttentionScores(q, k, valid, D**-0.5),
        "iga": lambda: IntegratedGradientScores(
            AttentionScores(q, k, valid, D**-0.5), GradientScores(grad_output, v), steps=4
        ),
        "rd": lambda: RandomScores(),
    }
    if kind in scores:
        return EditScores(drop=TopRegionRule(scores[kind](), 0.4, 0.5))
    if kind == "scheduled-dropout":
        return EditScores(drop=BernoulliRule(torch.tensor(0.3, device=q.device)))
    if kind == "attendout":  # a generator's per-sample mask, rows whose every key it drops made uniform
        drop = torch.rand(B, 1, T, T, generator=g).to(q.device) < 0.5
        drop[0, 0, 2] = True
        return EditScores(drop=drop, uniform_rows=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device))
    if kind == "layerdrop":
        return EditScores(uniform_rows=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device))
    raise ValueError(kind)


def _run(kind, dtype, device, autocast: bool):
    q, k, v, valid = _inputs(device)
    hook = _hook(kind, q, k, v, valid)
    # v in the autocast dtype, q and k float32: what the reported crash was handed
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v.to(dtype))]
    inputs = leaves if autocast else [x.to(dtype) for x in leaves]
    torch.manual_seed(11)
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        out, _ = attend(*inputs, valid, **HandPass(hook).call)
    weights = torch.linspace(-1, 1, out.numel(), device=device).view(out.shape)
    (out.float() * weights).sum().backward()
    return out, [x.grad for x in leaves]


KINDS = ["ga", "aa", "iga", "rd", "scheduled-dropout", "attendout", "layerdrop"]


def _check_follows_autocast(kind, dtype, device, split, monkeypatch):
    _blocks(monkeypatch, split)
    out, grads = _run(kind, dtype, device, autocast=True)
    expected, expected_grads = _run(kind, dtype, device, autocast=False)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for g, e, want in zip(grads, expected_grads, (torch.float32, torch.float32, dtype)):
        assert g.dtype == want
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("split", [True, False], ids=["blocks", "one-block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_runs_in_autocasts_dtype_forward_and_backward(kind, dtype, split, monkeypatch):
    _check_follows_autocast(kind, dtype, "cpu", split, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("split", [True, False], ids=["blocks", "one-block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_runs_in_cuda_autocasts_dtype_forward_and_backward(kind, dtype, split, monkeypatch):
    _check_follows_autocast(kind, dtype, "cuda", split, monkeypatch)
