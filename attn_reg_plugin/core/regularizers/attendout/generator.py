"""The Generator (G-Net, paper Sec. 4.1): per-layer drop logits for the Attacker's attention.

Its own token and position embeddings, ONE single-head attention whose parameters are shared by
all layers, no feed-forward. The layer-i attention scores, plus a shared bias and divided by the
temperature, are the drop logits of the Attacker's layer i.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...kernel.attention_call import AttentionSite
from ...kernel.devices import on_host
from ..options import flag_name
from .config import AttendOutConfig
from .policy import PolicyLogits

# Which token stream the generator reads for each attention kind: (query stream, key stream).
STREAMS_OF_KIND = {
    "encoder-self": ("source", "source"),
    "decoder-self": ("target", "target"),
    "encoder-decoder": ("target", "source"),
}


def real_key(stream: str) -> str:
    """The key of a stream's real tokens (bool, (B, L)) beside its token ids in the streams a game is
    given: where present, which tokens are real comes from it (the model's attention mask), not from
    the padding id, which may be a real token's too (an LM whose pad token is its EOS)."""
    return f"{stream}_real"


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

    def hidden_states(
        self,
        stream: str,
        tokens: torch.Tensor,
        num_layers: int,
        causal: bool,
        real: Optional[torch.Tensor] = None,
        projections: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None,
    ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Inputs of layers 0..num_layers-1 for one stream (B, L, d), and its real tokens (B, L):
        ``real`` where given, else the tokens that are not the stream's padding id. ``projections``:
        filled with each layer's (query(h), key(h)) its attention made.

        The layers run through sdpa with a key-padding mask (and ``is_causal`` where a causal stream
        has no padding before a real token, or on a device's route, :meth:`_device_mask`); a query row attends
        at least itself, so a padding row (whose states no real row reads) never meets an empty row."""
        length = tokens.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(
                f"{self.positions_option}: a sequence of {length} tokens is longer than the generator's "
                f"{self.positions.num_embeddings} positions; set {self.positions_option} to at least {length} "
                "(unset, it is the model's maximum length, or 1024 for a model that states none)"
            )
        real = tokens.ne(self.padding_idx[stream]) if real is None else real.to(device=tokens.device, dtype=torch.bool)
        # Positions count the sentence's own tokens (as fairseq's make_positions does): a
        # left-padded sentence (fairseq sources) gets the masks it gets unpadded, whatever batch it is in.
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        h = self.embeddings[stream](tokens) * self.dim**0.5 + self.positions(positions)
        states = [h]
        if num_layers > 1:
            mask, is_causal = self._attention_mask(real, causal)
            padded_keys = None if on_host(real) or not causal else _padded_key_column(real)
            for layer in range(num_layers - 1):
                q, k, v = (linear(h) for linear in (self.query, self.key, self.value))
                if projections is not None:
                    projections[layer] = (q, k)
                q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
                if mask is not None and mask.dtype == torch.bool:
                    # What sdpa makes of a bool mask at every call (0 where allowed, -inf elsewhere, in
                    # q's dtype), made once for all the layers: the same bits, fewer launches.
                    mask = torch.full(mask.shape, -math.inf, dtype=q.dtype, device=mask.device).masked_fill_(mask, 0.0)
                if padded_keys is None:
                    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
                else:
                    attn = _causal_with_padded_keys(q, k, v, padded_keys)
                h = self.norm(h + self.out(attn.squeeze(1)))
                states.append(h)
        return states, real

    @staticmethod
    def _attention_mask(real: torch.Tensor, causal: bool) -> Tuple[Optional[torch.Tensor], bool]:
        """(sdpa's mask, is_causal) of the Generator's own attention: real keys (and with ``causal``
        no later one) or the query's own position. Linear in length except for a causal stream with
        padding before a real token (left-padded), which needs its (L, L) mask.

        The looks at ``real`` that spare a mask are made where a look is free (:func:`on_host`); a
        device's route makes the mask that serves every batch instead (:meth:`_device_mask`)."""
        if not on_host(real):
            return Generator._device_mask(real, causal)
        length = real.shape[1]
        if not causal:
            if bool(real.all()):
                return None, False
            eye = torch.eye(length, dtype=torch.bool, device=real.device) if not bool(real.any(-1).all()) else None
            keys = real[:, None, None, :]
            return (keys if eye is None else keys | eye), False
        if not bool((~real[:, :-1] & real[:, 1:]).any()):  # no padding before a real token
            return None, True  # a real row's earlier keys are all real
        allowed = torch.ones(length, length, dtype=torch.bool, device=real.device).tril()
        return (real[:, None, None, :] & allowed) | torch.eye(length, dtype=torch.bool, device=real.device), False

    @staticmethod
    def _device_mask(real: torch.Tensor, causal: bool) -> Tuple[Optional[torch.Tensor], bool]:
        """The mask of :meth:`_attention_mask` with no host read (issue 80: a look is a sync on a
        device), linear in length. Not causal: a real query's keys are the host mask's; a query of a
        sample with no real token attends every key of its sample (not only itself). Causal: sdpa's
        ``is_causal``, padded keys shut by :func:`_causal_with_padded_keys`. Where a row differs from
        the host's (a padding query's), it is no unit of any policy (:class:`~.policy.PolicyLogits`):
        no drop changes."""
        if causal:
            return None, True
        # (B, 1, 1, L): real keys; every key in a sample with none, so that no row of sdpa's is all masked
        return real[:, None, None, :] | ~real.any(-1)[:, None, None, None], False

    def policies(self, streams: Dict[str, torch.Tensor], sites: Sequence[AttentionSite]) -> List[PolicyLogits]:
        """Each site's drop logits, as the factors a block makes its own logits from, in order; in
        float32 under any autocast (REINFORCE's log-probability, made outside it, must regenerate the
        actions). ``streams``: token ids per stream, and optionally each one's real tokens
        (:func:`real_key`)."""
        with torch.autocast(self.drop_bias.device.type, enabled=False):
            return self._policies(streams, sites)

    def _policies(self, streams: Dict[str, torch.Tensor], sites: Sequence[AttentionSite]) -> List[PolicyLogits]:
        needed: Dict[str, int] = {}
        for site in sites:
            for stream in STREAMS_OF_KIND[site.kind]:
                needed[stream] = max(needed.get(stream, 0), site.layer + 1)
        missing = [s for s in needed if s not in streams]
        if missing:
            raise ValueError(f"AttendOut: the generator needs the {missing[0]} tokens for the selected attention kinds")
        # Without autograd (the Attacker's masks), a site's query and key of a layer whose attention the
        # Generator ran are that attention's (the same op on the same states: the same bits, fewer
        # launches). With autograd (REINFORCE) each is made again, so that the gradients sum as they did.
        projected: Dict[str, Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = {s: {} for s in needed}
        kept = None if torch.is_grad_enabled() else projected
        states = {
            s: self.hidden_states(s, streams[s], n, s == "target", streams.get(real_key(s)), kept and kept[s])
            for s, n in needed.items()
        }
        offset = (self.drop_bias / self.temperature).float()
        # One look per stream, where a look is free: a stream with no padding makes no masks. A device's
        # route makes them (all true there, the same drops) rather than synchronise for the look.
        all_real = {s: on_host(real) and bool(real.all()) for s, (_, real) in states.items()}
        out = []
        for site in sites:
            q_stream, k_stream = STREAMS_OF_KIND[site.kind]
            (hq, q_real), (hk, k_real) = states[q_stream], states[k_stream]
            query = _projected(projected[q_stream], site.layer, 0, self.query, hq) * (self.dim**-0.5 / self.temperature)
            key = _projected(projected[k_stream], site.layer, 1, self.key, hk)
            causal = q_stream == k_stream == "target"
            every_unit = not causal and all_real[q_stream] and all_real[k_stream]
            out.append(PolicyLogits(query.float(), key.float(), offset, q_real, k_real, causal, every_unit))
        return out


def _projected(made: Dict[int, Tuple[torch.Tensor, torch.Tensor]], layer: int, which: int, linear, states):
    """``linear(states[layer])``: the one the Generator's attention made (``made[layer][which]``) where it did."""
    return made[layer][which] if layer in made else linear(states[layer])


# Far below any score of the Generator's float32 attention: exp of it is 0.
_SHUT = -1e9


def _padded_key_column(real: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, 1): 0 at a real key, :data:`_SHUT` at a padded one, the extra key feature of
    :func:`_causal_with_padded_keys`."""
    return (~real).to(torch.float32)[:, None, :, None] * _SHUT


def _causal_with_padded_keys(q, k, v, padded_keys: torch.Tensor) -> torch.Tensor:
    """sdpa with ``is_causal`` whose padded keys get no weight, in linear memory: q gains a feature 1
    and k the padded-key column, so a padded key's score is :data:`_SHUT` times the scale lower and a
    real one's is unchanged (it adds 1 x 0). A row whose earlier keys are all padding (a left-padding query, no unit)
    stays finite. v gains a zero feature, so that every head has one size (FlashAttention's)."""
    scale = q.shape[-1] ** -0.5
    q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
    k = torch.cat([k, padded_keys.to(k.dtype)], dim=-1)
    v = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :-1]
