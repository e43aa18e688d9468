"""The Generator (G-Net, paper Sec. 4.1): per-layer drop logits for the Attacker's attention.

Its own token and position embeddings, ONE single-head attention whose parameters are shared by
all layers, no feed-forward. The layer-i attention scores, plus a shared bias and divided by the
temperature, are the drop logits of the Attacker's layer i.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from ..attention_call import AttentionSite
from ..options import flag_name
from .config import AttendOutConfig

# Which token stream the generator reads for each attention kind: (query stream, key stream).
STREAMS_OF_KIND = {
    "encoder-self": ("source", "source"),
    "decoder-self": ("target", "target"),
    "encoder-decoder": ("target", "source"),
}


class Generator(nn.Module):
    """G-Net: per-layer drop logits from one shared single-head attention over its own embeddings.

    ``vocab_sizes`` / ``padding_idx`` per stream (``"source"``, ``"target"``); streams share
    one embedding table when they share a vocabulary (pass the same size and set
    ``share_streams``). Layer i's hidden state is ``LayerNorm(h + Attention(h))`` of layer i-1.
    """

    def __init__(
        self,
        vocab_sizes: Dict[str, int],
        padding_idx: Dict[str, int],
        dim: int,
        max_positions: int,
        init_drop: float,
        temperature: float,
        share_streams: bool = False,
        positions_option: str = flag_name(AttendOutConfig.FLAG_PREFIX, "max_positions"),
    ):
        super().__init__()
        self.dim, self.temperature, self.padding_idx = dim, float(temperature), dict(padding_idx)
        self.positions_option = positions_option  # how a too-long sequence's error names the option
        streams = list(vocab_sizes)
        if share_streams:
            table = nn.Embedding(vocab_sizes[streams[0]], dim, padding_idx=padding_idx[streams[0]])
            self.embeddings = nn.ModuleDict({s: table for s in streams})
        else:
            self.embeddings = nn.ModuleDict(
                {s: nn.Embedding(vocab_sizes[s], dim, padding_idx=padding_idx[s]) for s in streams}
            )
        for table in self.embeddings.values():
            nn.init.normal_(table.weight, std=dim**-0.5)
            nn.init.zeros_(table.weight[table.padding_idx])
        self.positions = nn.Embedding(max_positions, dim)
        nn.init.normal_(self.positions.weight, std=dim**-0.5)
        # The one attention head, shared by every layer (paper: "share one group of parameters").
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm = nn.LayerNorm(dim)
        # Shared offset of every drop logit: sets where the drop probability starts.
        self.drop_bias = nn.Parameter(torch.tensor(math.log(init_drop / (1 - init_drop)) * self.temperature))

    def _scores(self, hq: torch.Tensor, hk: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.query(hq), self.key(hk).transpose(-2, -1)) * self.dim**-0.5

    def hidden_states(
        self, stream: str, tokens: torch.Tensor, num_layers: int, causal: bool
    ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Inputs of layers 0..num_layers-1 for one stream, and its (B, 1, L, L) validity."""
        length = tokens.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(
                f"{self.positions_option}: a sequence of {length} tokens is longer than the generator's "
                f"{self.positions.num_embeddings} positions; set {self.positions_option} to at least {length} "
                "(unset, it is the model's maximum length, or 1024 for a model that states none)"
            )
        real = tokens.ne(self.padding_idx[stream])
        valid = real[:, None, None, :] & real[:, None, :, None]
        if causal:
            valid = valid & torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        # Positions count the sentence's own tokens (as fairseq's make_positions does): a
        # left-padded sentence (fairseq sources) gets the masks it gets unpadded, whatever batch it is in.
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        h = self.embeddings[stream](tokens) * self.dim**0.5 + self.positions(positions)
        states = [h]
        fill = torch.finfo(h.dtype).min / 4
        for _ in range(num_layers - 1):
            scores = self._scores(h, h).unsqueeze(1).masked_fill(~valid, fill)
            attn = torch.softmax(scores, dim=-1).squeeze(1)
            h = self.norm(h + self.out(torch.matmul(attn, self.value(h))))
            states.append(h)
        return states, valid

    def drop_logits(
        self, streams: Dict[str, torch.Tensor], sites: Sequence[AttentionSite]
    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(logits (B, 1, T, S), valid units (B, 1, T, S)) for each site, in order."""
        needed: Dict[str, int] = {}
        for site in sites:
            for stream in STREAMS_OF_KIND[site.kind]:
                needed[stream] = max(needed.get(stream, 0), site.layer + 1)
        missing = [s for s in needed if s not in streams]
        if missing:
            raise ValueError(f"AttendOut: the generator needs the {missing[0]} tokens for the selected attention kinds")
        states = {s: self.hidden_states(s, streams[s], n, causal=(s == "target")) for s, n in needed.items()}
        out = []
        for site in sites:
            q_stream, k_stream = STREAMS_OF_KIND[site.kind]
            hq, hk = states[q_stream][0][site.layer], states[k_stream][0][site.layer]
            if q_stream == k_stream:
                valid = states[q_stream][1]
            else:
                q_real = streams[q_stream].ne(self.padding_idx[q_stream])
                k_real = streams[k_stream].ne(self.padding_idx[k_stream])
                valid = q_real[:, None, :, None] & k_real[:, None, None, :]
            logits = (self._scores(hq, hk).unsqueeze(1) + self.drop_bias) / self.temperature
            out.append((logits.float(), valid))
        return out
