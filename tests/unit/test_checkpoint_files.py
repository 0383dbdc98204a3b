"""Which checkpoint files a node's ranks load (train/checkpoint_files.py): DeepSpeed 0.19's file names, the
expected sets written out by hand from what its load opens."""
from __future__ import annotations

import pytest

from spotfill.train.checkpoint_files import node_files

MODEL = "rank-0/mp_rank_00_model_states.pt"


def zero2(world: int) -> list[str]:
    return [MODEL] + [f"rank-{r}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]


@pytest.mark.parametrize("files,ranks,saved,world,expected", [
    (zero2(4), [2, 3], 4, 4, {MODEL, "rank-2/zero_pp_rank_2_mp_rank_00_optim_states.pt",
                              "rank-3/zero_pp_rank_3_mp_rank_00_optim_states.pt"}),
    (zero2(4), [0], 4, 4, {MODEL, "rank-0/zero_pp_rank_0_mp_rank_00_optim_states.pt"}),
    (zero2(4), [0, 1], 4, 2, set(zero2(4))),                      # another size: every partition merges
    (zero2(2), [0], 2, 3, set(zero2(2))),
    ([MODEL, "rank-1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
      "rank-0/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"], [1], 2, 2,
     {MODEL, "rank-1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}),
    ([MODEL, "rank-1/zero_pp_rank_1_mp_rank_00_model_states.pt", "rank-1/zero_pp_rank_1_mp_rank_00_optim_states.pt",
      "rank-0/zero_pp_rank_0_mp_rank_00_model_states.pt"], [1], 2, 2,                       # ZeRO-3
     {MODEL, "rank-1/zero_pp_rank_1_mp_rank_00_model_states.pt", "rank-1/zero_pp_rank_1_mp_rank_00_optim_states.pt"}),
    ([MODEL], [3], 1, 4, {MODEL}),                                 # ZeRO-0: one file, everyone reads it
])
def test_a_node_reads_the_model_and_its_own_ranks_partitions(files, ranks, saved, world, expected):
    assert node_files(files, ranks, saved, world) == expected


def test_a_rigid_zero12_checkpoint_is_read_whole_by_deepspeeds_loader():
    assert node_files(zero2(4), [1], 4, 4, own_only=False) == set(zero2(4))


@pytest.mark.parametrize("odd", [
    "rank-0/layer_01-model_states.pt",                             # a pipeline stage's layers
    "rank-1/zero_pp_rank_1_mp_rank_01_optim_states.pt",            # model parallel rank 1
    "rank-0/universal/zero/x.pt",                                  # nested
    "manifest-extra.json",
])
def test_a_layout_it_does_not_know_means_every_file(odd):
    assert node_files(zero2(2) + [odd], [0], 2, 2) is None


def test_the_model_cards_files_are_read_by_no_rank():
    """rank 0's part carries the tokenizer's files (train/model_card.py): a node brings only what its ranks
    load, not them, and not everything."""
    card = ["rank-0/spotfill-model/tokenizer.json", "rank-0/spotfill-model/tokenizer_config.json"]
    assert node_files(zero2(2) + card, [1], 2, 2) == {MODEL, "rank-1/zero_pp_rank_1_mp_rank_00_optim_states.pt"}
