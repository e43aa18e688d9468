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
    if at_least is None:
        at_least = as_bytes(region).sum(-1, keepdim=True, dtype=torch.int32)
    if scores.device.type != "cpu" or torch.compiler.is_compiling():  # no data-dependent shapes in a graph
        return _ranked_by_scan(scores == threshold, region, k, at_least)
    # On a CPU, the rows where ties straddle the threshold are ranked (gathered, where they are at
    # most half of the rows: the others keep their region), by a scan or from positions.
    keys = scores.shape[-1]
    rows = scores.shape[:-1] + (1,)
    straddling = (at_least > k).expand(rows).reshape(-1)
    tied = straddling.nonzero().squeeze(1) if 2 * int(straddling.sum()) <= straddling.numel() else None
    region = region.contiguous()  # written through a flat view (scores may be permuted, T5's)

    def of_tied(x):
        x = x.expand(rows if x.shape[-1] == 1 else scores.shape).reshape(-1, x.shape[-1])
        return x if tied is None else x.index_select(0, tied)

    tied_scores, tied_threshold, tied_k = of_tied(scores), of_tied(threshold), of_tied(k)
    equal = tied_scores == tied_threshold
    # A row's scan (cumsum) costs about 5 ns a key. Where the tied keys are many (a row whose
    # attribution is 0, as a padding query's, or under a classifier's [CLS] pooling every other
    # query's in the last layer: every valid key ties), the rows are scanned; where they are few
    # (repeated tokens' values tie) they are ranked from their positions, 2.4x faster than a scan
    # on a (1, 4, 64, 4096) block of a causal LM's first layer.
    positions = equal.nonzero(as_tuple=True)
    if 16 * positions[0].numel() >= equal.numel():
        ranked = _ranked_by_scan(equal, of_tied(region), tied_k, of_tied(at_least))
    else:
        ranked = _ranked_by_position(positions, equal.shape[0], tied_scores > tied_threshold, tied_k)
    if tied is None:
        return ranked.view(region.shape)
    region.view(-1, keys).index_copy_(0, tied, ranked)
    return region


def _ranked_by_scan(equal, region, k, at_least) -> torch.Tensor:
    """Of each row's keys equal to the threshold, the first ``k - (at_least - equal)``, by a scan."""
    take = k - (at_least - as_bytes(equal).sum(-1, keepdim=True, dtype=torch.int32))
    return (region & ~equal) | (equal & (equal.cumsum(-1, dtype=torch.int32) <= take))


def _ranked_by_position(positions, n_rows: int, above, k) -> torch.Tensor:
    """(R, S) rows: ``above`` and of the keys equal to the threshold (at ``positions``, as
    ``nonzero`` gives them) the first ``k - above``, ranked from their positions (no scan of a row)."""
    take = k - as_bytes(above).sum(-1, keepdim=True, dtype=torch.int32)
    rows, cols = positions
    counts = torch.bincount(rows, minlength=n_rows)
    rank = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    keep = rank < take.reshape(-1)[rows]
    above[rows[keep], cols[keep]] = True
    return above


__all__: Sequence[str] = ("kth_largest", "lowest_keys_first")
