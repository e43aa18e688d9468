"""A compact encoder-decoder Transformer in plain PyTorch, ported to AD-DROP via the core API.

What the port takes (steps 1 and 2 of ``attn_reg_plugin.core``'s guide): every attention
module registers an ``AttentionSite`` with the model's ``RegularizationController`` when it
is built, and calls ``attend`` with that site instead of its own softmax(QK^T)V. Nothing
else in the model knows about AD-DROP; steps 3 and 4 live in the training loop (train.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from attn_reg_plugin.core import AttentionSite, RegularizationController, attend


class MultiheadAttention(nn.Module):
    """Multi-head attention whose kernel is the plugin's ``attend`` (step 2)."""

    def __init__(self, dim: int, heads: int, dropout: float, site: Optional[AttentionSite] = None):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model width {dim} is not divisible by {heads} heads")
        self.heads, self.head_dim, self.dropout, self.site = heads, dim // heads, dropout, site
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, d)
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, query: torch.Tensor, memory: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """query (B, T, D), memory (B, S, D); ``allowed`` bool, True where a query may see a key, (B, 1, T|1, S)."""
        q, k, v = self._split(self.q_proj(query)), self._split(self.k_proj(memory)), self._split(self.v_proj(memory))
        out, _ = attend(q, k, v, bias=allowed, dropout_p=self.dropout if self.training else 0.0, site=self.site)
        return self.out_proj(out.transpose(1, 2).reshape(query.shape))


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, ffn_dim: int, dropout: float):
        super().__init__(nn.Linear(dim, ffn_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, dim))


class Residual(nn.Module):
    """``x + dropout(f(x))`` with LayerNorm before f (pre-LN) or after the sum (post-LN)."""

    def __init__(self, dim: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm, self.dropout, self.pre_norm = nn.LayerNorm(dim), nn.Dropout(dropout), pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim, dropout, attention_dropout, pre_norm, site):
        super().__init__()
        self.self_attn = MultiheadAttention(dim, heads, attention_dropout, site)
        self.ffn = FeedForward(dim, ffn_dim, dropout)
        self.attn_block, self.ffn_block = Residual(dim, dropout, pre_norm), Residual(dim, dropout, pre_norm)

    def forward(self, x, allowed):
        x = self.attn_block(x, lambda h: self.self_attn(h, h, allowed))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim, dropout, attention_dropout, pre_norm, self_site, cross_site):
        super().__init__()
        self.self_attn = MultiheadAttention(dim, heads, attention_dropout, self_site)
        self.cross_attn = MultiheadAttention(dim, heads, attention_dropout, cross_site)
        self.ffn = FeedForward(dim, ffn_dim, dropout)
        self.blocks = nn.ModuleList(Residual(dim, dropout, pre_norm) for _ in range(3))

    def forward(self, x, memory, self_allowed, cross_allowed):
        x = self.blocks[0](x, lambda h: self.self_attn(h, h, self_allowed))
        x = self.blocks[1](x, lambda h: self.cross_attn(h, memory, cross_allowed))
        return self.blocks[2](x, self.ffn)


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """(length, dim): sin on even, cos on odd features, wavelengths 2*pi .. 10000*2*pi (Vaswani et al.)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : dim // 2]
    return table


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder with one joint vocabulary; input, output embeddings tied.

    Its attention modules register their sites with ``self.controller`` (step 1): one per
    encoder layer (``encoder-self``), two per decoder layer (``decoder-self``, ``encoder-decoder``).
    """

    def __init__(
        self,
        vocab_size: int,
        pad_id: int,
        dim: int = 128,
        heads: int = 4,
        ffn_dim: int = 512,
        encoder_layers: int = 3,
        decoder_layers: int = 3,
        dropout: float = 0.3,
        attention_dropout: float = 0.1,
        pre_norm: bool = True,
        positions: str = "sinusoidal",
        max_positions: int = 256,
        controller: Optional[RegularizationController] = None,
    ):
        super().__init__()
        if positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {positions!r}")
        self.controller = controller if controller is not None else RegularizationController()
        self.pad_id, self.dim, self.max_positions = pad_id, dim, max_positions
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, std=dim**-0.5)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        if positions == "learned":
            self.positions = nn.Embedding(max_positions, dim)
            nn.init.normal_(self.positions.weight, std=dim**-0.5)
        else:
            self.register_buffer("sinusoids", sinusoidal_positions(max_positions, dim), persistent=False)
            self.positions = None
        self.dropout = nn.Dropout(dropout)
        reg = self.controller.register
        self.encoder = nn.ModuleList(
            EncoderLayer(dim, heads, ffn_dim, dropout, attention_dropout, pre_norm, reg("encoder-self", i))
            for i in range(encoder_layers)
        )
        self.decoder = nn.ModuleList(
            DecoderLayer(
                dim,
                heads,
                ffn_dim,
                dropout,
                attention_dropout,
                pre_norm,
                reg("decoder-self", i),
                reg("encoder-decoder", i),
            )
            for i in range(decoder_layers)
        )
        # Pre-LN stacks end un-normalised: one final LayerNorm per stack.
        self.encoder_norm = nn.LayerNorm(dim) if pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(dim) if pre_norm else nn.Identity()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.max_positions:
            raise ValueError(f"sequence of {length} tokens is longer than max_positions={self.max_positions}")
        pos = self.positions.weight[:length] if self.positions is not None else self.sinusoids[:length]
        return self.dropout(self.embed(tokens) * math.sqrt(self.dim) + pos)

    def encode(self, src: torch.Tensor):
        """src (B, S) -> memory (B, S, D) and the key mask (B, 1, 1, S) that hides padding."""
        allowed = src.ne(self.pad_id)[:, None, None, :]
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, allowed)
        return self.encoder_norm(x), allowed

    def decode(self, prev: torch.Tensor, memory: torch.Tensor, memory_allowed: torch.Tensor) -> torch.Tensor:
        """prev (B, T) decoder inputs -> logits (B, T, V); each position sees itself and earlier ones."""
        length = prev.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=prev.device).tril()
        self_allowed = causal[None, None] & prev.ne(self.pad_id)[:, None, None, :]
        x = self._embed(prev)
        for layer in self.decoder:
            x = layer(x, memory, self_allowed, memory_allowed)
        return F.linear(self.decoder_norm(x), self.embed.weight)

    def forward(self, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        memory, allowed = self.encode(src)
        return self.decode(prev, memory, allowed)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, bos_id: int, eos_id: int, max_len: int) -> torch.Tensor:
        """Greedy decoding (B, <= max_len) without an incremental cache: each step re-runs the decoder."""
        if max_len > self.max_positions - 1:
            raise ValueError(f"max_len {max_len} needs {max_len + 1} positions; the model has {self.max_positions}")
        memory, allowed = self.encode(src)
        out = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            nxt = self.decode(out, memory, allowed)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(done, self.pad_id)
            out = torch.cat([out, nxt[:, None]], dim=1)
            done |= nxt.eq(eos_id)
            if bool(done.all()):
                break
        return out[:, 1:]
