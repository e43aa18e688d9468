"""Each row's exact threshold and region: the k-th largest score of a row, and the keys at or above
it, ties taken lowest key first (:class:`~.block_rules.TopRegionRule`'s selection)."""

from __future__ import annotations

from typing import Sequence

import torch

try:  # torch's CPU wheels come with numpy, but do not require it
    import numpy as _numpy
except ImportError:  # pragma: no cover
    _numpy = None


def as_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 0/1, to sum or take minima in a narrow dtype: a view in eager, a cast
    while compiling, since Inductor cannot lower a bool->uint8 view (on CUDA, torch 2.11: "torch.bool
    is not supported by torch.iinfo")."""
    return mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)


def kth_largest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest score, (..., 1); ``k`` (..., 1) per row, at least 1 where it matters
    (a row with k = 0 gets its largest). On a CPU, numpy's selection on the values alone, one
    partition per group of rows sharing k: for 128 rows of 4,096 keys and one k, 0.65 ms against
    torch.topk's 4.4 ms; for a causal block (20 values of k over 256 rows) 0.70 ms against 5.0 ms
    for one partition at every k. Elsewhere (another device, bfloat16, which numpy lacks), torch.topk;
    while torch.compile traces, a sort (a top-k's size would be read from k on the host)."""
    rows = scores.shape[:-1] + (1,)
    k = k.clamp(min=1, max=scores.shape[-1]).expand(rows)
    on_numpy = scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64, torch.float16)
    if torch.compiler.is_compiling():  # no host read of k: a sorted row, traced whatever k holds
        return scores.sort(dim=-1, descending=True).values.gather(-1, k - 1)
    if _numpy is not None and on_numpy:
        return _kth_largest_numpy(scores, k)
    k_top, k_least = int(k.max()), int(k.min())
    # An unsorted top-k (half the cost of a sorted one on a CPU), then each row's k-th largest
    # from the few smallest of it: rows of a block differ in k by a few (padding, causality).
    top = scores.topk(k_top, dim=-1, sorted=False).values
    if k_least == k_top:  # every row takes the same k (no padding or causality in the block)
        return top.amin(-1, keepdim=True)
    ascending = top.topk(k_top - k_least + 1, dim=-1, largest=False, sorted=True).values
    return ascending.gather(-1, k_top - k)  # the k-th largest, counted from the least


def _kth_largest_numpy(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    keys = scores.shape[-1]
    values = scores.detach().numpy().reshape(-1, keys)
    position = (keys - k).reshape(-1).numpy()  # in ascending order; invalid keys (-inf) come first
    out = _numpy.empty(position.shape, dtype=values.dtype)
    order = _numpy.argsort(position, kind="stable")
    for group in _numpy.split(order, _numpy.flatnonzero(_numpy.diff(position[order])) + 1):
        at = position[group[0]]
        part = values[group]  # a copy, partitioned in place
        part.partition(at, axis=-1)
        out[group] = part[:, at]
    return torch.from_numpy(out).view(k.shape)


def lowest_keys_first(scores, threshold, k, region, at_least) -> torch.Tensor:
    """The region when ties straddle the threshold in some row: the keys above it, then of the keys
    equal to it the lowest-indexed ones, up to k per row."""
    equal = scores == threshold
    if scores.device.type != "cpu" or torch.compiler.is_compiling():  # no data-dependent shapes in a graph
        if at_least is None:
            at_least = as_bytes(region).sum(-1, keepdim=True, dtype=torch.int32)
        take = k - (at_least - as_bytes(equal).sum(-1, keepdim=True, dtype=torch.int32))
        return (region & ~equal) | (equal & (equal.cumsum(-1, dtype=torch.int32) <= take))
    # On a CPU a row's scan (cumsum) costs about 5 ns a key; the keys at the threshold are few
    # (repeated tokens' values tie), so they are ranked from their positions: 2.4x faster on a
    # (1, 4, 64, 4096) block of a causal LM's first layer.
    above = (scores > threshold).contiguous()  # written through a flat view below (scores may be permuted, T5's)
    take = (k - as_bytes(above).sum(-1, keepdim=True, dtype=torch.int32)).expand(equal.shape[:-1] + (1,))
    flat = equal.reshape(-1, equal.shape[-1])
    rows, cols = flat.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=flat.shape[0])
    rank = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    keep = rank < take.reshape(-1)[rows]
    above.view(-1, above.shape[-1])[rows[keep], cols[keep]] = True
    return above


__all__: Sequence[str] = ("kth_largest", "lowest_keys_first")
