"""One rank's share of a ZeRO-1/2 state merged from every saved partition, without building the merge.

DeepSpeed's elastic load concatenates every saved rank's partition of a state (fp32 weights, Adam moments),
pads the result with zeros to a multiple of its alignment and cuts it into equal parts, one per rank: each
rank held every saved partition plus the full concatenation in memory to keep one part of it (node memory =
local ranks x twice the optimizer state). The same part is a window [start, start + size) of that
concatenation: `copy_window` copies the piece of one saved partition that overlaps it straight into the
live tensor, so a loader can go through the saved files one at a time (memory-mapped: only the pages in the
window are read) and let each go before the next.
"""
from __future__ import annotations


def merged_part_bounds(lengths: list[int], alignment: int, world: int, rank: int) -> tuple[int, int]:
    """(start, size) of rank `rank`'s part of the concatenation of partitions of `lengths` elements, padded
    to a multiple of `alignment` and split into `world` equal parts (DeepSpeed's
    flatten_dense_tensors_aligned + get_data_parallel_partitions, alignment a multiple of world)."""
    total = sum(lengths)
    padded = -(-total // alignment) * alignment
    size = padded // world
    return rank * size, size


def copy_window(dst, part, offset: int, start: int) -> None:
    """`part` holds elements [offset, offset + numel) of the concatenation; copy those that fall in the
    window [start, start + dst.numel()) into `dst` (a contiguous tensor, written through a flat view)."""
    flat, out = part.reshape(-1), dst.view(-1)
    lo, hi = max(start, offset), min(start + out.numel(), offset + flat.numel())
    if lo < hi:
        out[lo - start:hi - start].copy_(flat[lo - offset:hi - offset])


def zero_past(dst, total: int, start: int) -> None:
    """Zero the part of the window past the concatenation's end (DeepSpeed's alignment padding)."""
    out = dst.view(-1)
    if start + out.numel() > total:
        out[max(0, total - start):].zero_()
