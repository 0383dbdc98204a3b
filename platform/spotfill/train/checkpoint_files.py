"""Which files of a DeepSpeed checkpoint a node's ranks read when they load it (pure).

A spotfill manifest lists each saving rank's files as `rank-<r>/<name>`. DeepSpeed (0.19, no model or
pipeline parallelism: mp rank 00) writes

    mp_rank_00_model_states.pt                             the module, LR scheduler, client state (dp rank 0)
    zero_pp_rank_<d>_mp_rank_00_optim_states.pt            dp rank d's ZeRO optimizer partition
    bf16_zero_pp_rank_<d>_mp_rank_00_optim_states.pt       the same, from the bf16 optimizer (no ZeRO)
    zero_pp_rank_<d>_mp_rank_00_model_states.pt            dp rank d's ZeRO-3 parameter partition

and its load reads, on rank d: the model states file, and at the saved world size only its own
`..._rank_<d>_...` partitions -- through spotfill's elastic ZeRO-1/2 load (ray_compat.zero_load_elastic) and
DeepSpeed's own load without `elastic_checkpoint` (ZeRO-0/3). DeepSpeed's own load of a ZeRO-1/2 checkpoint
in the rigid layout, with the engine's `elastic_checkpoint` on (spotfill configures it), reads every rank's
file (`own_only=False`); so does any load at another world size (the partitions are merged). A file this
does not know (pipeline layer files, model parallel ranks, anything newer) makes the answer None: download
everything, correct by construction. The model card's files (`rank-0/spotfill-model/...`) are read by no
rank. These names are DeepSpeed's (ray_compat hook restore_node_files: where the installed DeepSpeed names its
files otherwise, train/restore.py does not call this and every node downloads everything).
"""
from __future__ import annotations

import re
from typing import Iterable

# DeepSpeed's file names (private: they live in ray_compat, hook restore_node_files; importing them imports
# no DeepSpeed)
from spotfill.ray_compat.deepspeed_engine import DS_MODEL_FILE as _MODEL
from spotfill.ray_compat.deepspeed_engine import DS_PARTITION_FILE as _PARTITION
from spotfill.train.model_card import MODEL_DIR


def node_files(files: Iterable[str], node_ranks: Iterable[int], saved_world: int, world: int,
               own_only: bool = True) -> set[str] | None:
    """The manifest entries (`rank-<r>/<name>`) the ranks `node_ranks` of a `world`-rank group read when
    they load a checkpoint saved by `saved_world` ranks (`own_only`: the load reads only a rank's own
    partition at the saved size); None when every file is needed or the layout is not one this knows."""
    ranks = set(node_ranks)
    out: set[str] = set()
    for rel in files:
        folder, _, name = rel.partition("/")
        if re.fullmatch(r"rank-\d+", folder) and name.startswith(MODEL_DIR + "/"):
            continue            # the model card's tokenizer files (train/model_card.py): no rank loads them
        if not re.fullmatch(r"rank-\d+", folder) or "/" in name:
            return None
        if _MODEL.match(name):
            out.add(rel)
            continue
        m = _PARTITION.match(name)
        if m is None:
            return None
        if saved_world != world or not own_only or int(m.group(1)) in ranks:
            out.add(rel)
    return out
