"""ray_compat/zero_merge.py: a rank's window of the aligned concatenation, numbers worked out by hand."""
import torch

from spotfill.ray_compat.zero_merge import copy_window, merged_part_bounds, zero_past


def test_parts_of_seven_elements_over_three_ranks_with_alignment_six():
    # 3 + 4 = 7 elements, padded to 12 (alignment 2 x 3 ranks), 4 per rank: [0..3] [4..7] [8..11]
    assert [merged_part_bounds([3, 4], 6, 3, r) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]
    parts = [torch.tensor([1., 2., 3.]), torch.tensor([4., 5., 6., 7.])]
    windows = []
    for rank in range(3):
        start, size = merged_part_bounds([3, 4], 6, 3, rank)
        dst = torch.full((size,), -1.0)           # the live partition holds something else before the load
        zero_past(dst, 7, start)
        offset = 0
        for part in parts:                        # one saved file at a time, as the loader goes
            copy_window(dst, part, offset, start)
            offset += part.numel()
        windows.append(dst.tolist())
    assert windows == [[1., 2., 3., 4.], [5., 6., 7., 0.], [0., 0., 0., 0.]]


def test_one_rank_takes_everything_and_a_2d_part_is_read_flat():
    start, size = merged_part_bounds([4, 4], 2, 1, 0)
    assert (start, size) == (0, 8)
    dst = torch.zeros(8)
    copy_window(dst, torch.arange(4.).reshape(2, 2), 0, start)
    copy_window(dst, torch.arange(4., 8.), 4, start)
    assert dst.tolist() == [0., 1., 2., 3., 4., 5., 6., 7.]
