"""Pipeline-parallel training of the GPT presets: DeepSpeed's PipelineModule and PipelineEngine.

`training.pipeline_stages: S` (> 1) cuts a preset into layers -- the embeddings, each transformer block, the
final norm with the LM head -- and DeepSpeed partitions them over S stages (by parameter count). Ray Train
gives W ranks; W / S data-parallel replicas each run one pipeline. The topology puts a replica's stages on
consecutive ranks (axes data, pipe: rank = replica x S + stage) and Ray Train numbers the workers of a node
consecutively, so a node holding a multiple of S workers holds whole replicas: a node loss removes whole
replicas, and the job resumes on the rest with the same global batch (pipe_layout.py's arithmetic).

Every layer is initialised from its own generator seeded by (seed, global layer index), so the weights of a
layer do not depend on S or on which stage builds it; checkpoints are saved per layer
(`layer_XX-model_states.pt`) and load at any S through DeepSpeed's universal checkpoint (train/restore.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from spotfill.train.model import Block
from spotfill.config.presets import GPTConfig


def _init_layer(module: nn.Module, seed: int, index: int, n_layer: int) -> None:
    """GPT's initialisation (model.GPT) from a generator of this layer's own: N(0, 0.02) weights, zero
    biases, the residual projections scaled by 1/sqrt(2 n_layer); LayerNorms keep ones and zeros."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    with torch.no_grad():
        for name, p in module.named_parameters():
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            if isinstance(owner, nn.LayerNorm):
                continue
            if name.endswith("bias"):
                p.zero_()
                continue
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)


class PipeEmbed(nn.Module):
    """Layer 0: token and position embeddings; token ids in, activations out."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        _init_layer(self, seed, 0, cfg.n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class PipeBlock(Block):
    """Layers 1..n_layer: one transformer block (model.Block)."""

    def __init__(self, cfg: GPTConfig, index: int, seed: int = 0):
        super().__init__(cfg)
        _init_layer(self, seed, index, cfg.n_layer)


class PipeHead(nn.Module):
    """The last layer: final LayerNorm and the LM head; logits out."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        _init_layer(self, seed, cfg.n_layer + 1, cfg.n_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (the loss worker_loop trains the unpipelined presets with)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def replica_topology(replicas: int, stages: int):
    """Ranks laid out replica-major: rank = replica x stages + stage (a replica's stages are neighbours)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology
    return ProcessTopology(axes=["data", "pipe"], dims=[replicas, stages])


def build_pipeline_module(cfg: GPTConfig, stages: int, replicas: int, seed: int = 0):
    """The preset as a PipelineModule over `stages` x `replicas` ranks (torch.distributed initialised)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    from spotfill.ray_compat import skip_deepspeed_shm_comm
    skip_deepspeed_shm_comm()      # no JIT build of an inference-only comm op (train.engine says why)
    deepspeed.init_distributed(dist_backend=dist.get_backend())   # DeepSpeed's comm over torch's group
    layers = [LayerSpec(PipeEmbed, cfg, seed)]
    layers += [LayerSpec(PipeBlock, cfg, i + 1, seed) for i in range(cfg.n_layer)]
    layers.append(LayerSpec(PipeHead, cfg, seed))
    module = PipelineModule(layers=layers, topology=replica_topology(replicas, stages), loss_fn=lm_loss,
                            partition_method="parameters", activation_checkpoint_interval=0)
    module.cfg = cfg
    return module


def stage_layers(module) -> tuple[int, int]:
    """[first, last + 1) global layer indices this rank's stage holds."""
    from spotfill.ray_compat import pipe_stage_layers
    return pipe_stage_layers(module)


def pipeline_ds_config(config: dict) -> dict:
    """A ds_config (engine.ds_config) for a pipeline: DeepSpeed's pipeline section with partitioning off
    (no tensor slicing here), and ZeRO-1 optimizer state in DeepSpeed's default layout -- the one its
    universal-checkpoint converter reads (it cannot read the elastic layout), which is how a pipeline
    checkpoint reshards to another stage count or replica count (train/restore.py)."""
    zero = {k: v for k, v in config.get("zero_optimization", {}).items() if k != "elastic_checkpoint"}
    return {**config, "zero_optimization": zero,
            "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}


def micro_batch_iter(micro_batches):
    """(inputs, labels) tensors per micro-batch of token rows [rows, seq+1] (numpy), for train_batch: the
    first stage feeds the inputs, the last the labels."""
    for mb in micro_batches:
        t = torch.from_numpy(mb.astype("int64", copy=False))
        yield t[:, :-1], t[:, 1:]


class PipelineRun:
    """The pipeline path of one rank of the worker loop (train/worker_loop.py): its place, its share of
    each step's samples, its engine and its step."""

    def __init__(self, job, world: int, rank: int, node_id: str = "", bubble_filler=None):
        from spotfill.config.pipe_layout import check_pipeline_range, layout, pipeline_batch_shape

        t = job.training
        self.layout = layout(t.pipeline_stages, world, rank)
        micro = check_pipeline_range(t.global_batch, t.pipeline_stages, t.min_workers, t.max_workers,
                                     t.micro_batches, t.max_micro_batch)
        self.shape = pipeline_batch_shape(t.global_batch, self.layout.replicas, micro)
        self.probe = None
        self.node_id, self.replica_nodes = node_id, []
        self.filler = None      # fill work for the bubbles, set before build_engine, or built there by
        self.bubble_filler = bubble_filler      # bubble_filler(output, rank, world, device, sync) -- passed in:
                                                # fill-in (fillin/bubble_fill.py) sits above training

    def positions(self, step: int):
        """The stream positions this rank reads at `step`: its replica's share on the first and last stage
        (inputs and labels of the same rows), none on a middle stage."""
        import numpy as np

        from spotfill.config.batching import rank_positions
        if not self.layout.reads_data:
            return np.zeros(0, dtype=np.int64)
        return rank_positions(step, self.shape, self.layout.replica)

    @property
    def records_feeds(self) -> bool:
        """Only the first stage feeds samples to the model: it alone records them in the ledger."""
        return self.layout.feeds_inputs

    def build_engine(self, job, seq_len: int, vocab_size: int, precision: str, universal: bool, device=None):
        """(engine, vocab, flops) as worker_loop._engine returns them, for this rank's stage."""
        from spotfill.train.engine import build_engine, ds_config
        from spotfill.train.model import count_params, model_flops
        from spotfill.config.presets import preset

        t = job.training
        cfg = preset(t.model, seq_len=seq_len, vocab_size=vocab_size)
        module = build_pipeline_module(cfg, self.layout.stages, self.layout.replicas, seed=t.seed)
        config = pipeline_ds_config(ds_config(job, self.shape.micro_batch, self.shape.accum, precision, universal))
        engine = build_engine(module, config, device)
        self._check_grid(engine.grid)
        from spotfill.train.bubble_probe import BubbleProbe
        sync = torch.cuda.synchronize if getattr(engine.device, "type", "") == "cuda" else None
        if t.bubble_fill and self.filler is None and self.bubble_filler is not None:
            self.filler = self.bubble_filler(t.bubble_fill, self.layout.rank, self.layout.world, engine.device, sync)
        self.probe = BubbleProbe(engine, filler=self.filler, sync=sync)
        params = _whole_model_params(cfg)
        fm, fh = model_flops(cfg, params, seq_len, recompute="none")
        self.stage_span = stage_layers(module)
        return engine, cfg.vocab_size, {"params": params, "flops_per_token": fm, "hardware_flops_per_token": fh,
                                        "recompute": "none", "stage_params": count_params(module)}

    def train_step(self, engine, micro_batches) -> float:
        """One optimizer step through the pipeline schedule; the step's mean loss (every stage has it)."""
        data = micro_batch_iter(micro_batches) if self.layout.reads_data else None
        return float(self.probe.step(lambda: engine.train_batch(data_iter=data)))

    def step_values(self) -> tuple[float, float, float, float]:
        """This rank's bubble, fill and schedule seconds of the last step and the fill rows it has done so
        far, for the step's gather."""
        last = self.probe.last
        return (last.bubble_s, last.fill_s, last.wall_s, float(self.filler.rows if self.filler else 0))

    def split(self) -> tuple[float, float]:
        """(forward+backward, optimizer) seconds of this stage's last step, for rank 0's step split."""
        return self.probe.last.forward_backward_s, self.probe.last.optimizer_s

    def step_fields(self, rows: list[list[float]]) -> dict:
        """A step event's pipeline fields from every rank's gathered (bubble, fill, wall) seconds (after
        the step's 4 flags): bubble_s and bubble_fill_s summed over ranks (GPU-seconds), per stage the
        mean over replicas, and the step's bubble share."""
        from spotfill.train.bubble import per_stage
        bubble, fill, wall, done = ([r[4 + i] for r in rows] for i in range(4))
        return {"stages": self.layout.stages, "micro_batches": self.shape.accum,
                "bubble_s": round(sum(bubble), 6), "bubble_fill_s": round(sum(fill), 6),
                "bubble_fill_rows": int(sum(done)),
                "bubble_stage_s": [round(x, 6) for x in per_stage(bubble, self.layout.stages)],
                "bubble_fraction": round(sum(bubble) / sum(wall), 4) if sum(wall) > 0 else None}

    def close(self) -> None:
        """Let the bubble fill's last unit commit (its writer thread)."""
        if self.filler is not None:
            self.filler.work.close()

    def checkpoint_meta(self) -> dict:
        """Recorded in every checkpoint's manifest: restore reshards when the stage count changes."""
        return {"pipeline_stages": self.layout.stages}

    def _check_grid(self, grid) -> None:
        """The engine's own grid must put this rank where the layout does (its data is read by the layout),
        and says which nodes each replica's ranks are on (one collective at start): a replica whose stages
        span nodes is lost with either node, which the start event and a warning say."""
        import logging

        import torch.distributed as dist
        actual = (grid.get_data_parallel_id(), grid.get_stage_id())
        if actual != (self.layout.replica, self.layout.stage):
            raise RuntimeError(f"rank {self.layout.rank}: DeepSpeed's grid has it at (replica, stage) {actual}, "
                               f"the pipeline layout at {(self.layout.replica, self.layout.stage)}")
        places = [None] * self.layout.world
        dist.all_gather_object(places, (self.node_id, actual[0]))
        self.replica_nodes = [sorted({node for node, replica in places if replica == d})
                              for d in range(self.layout.replicas)]
        spanning = [d for d, n in enumerate(self.replica_nodes) if len(n) > 1]
        if spanning and self.layout.rank == 0:
            logging.getLogger(__name__).warning(
                "pipeline replicas %s span more than one node: losing any of those nodes loses the replica "
                "(give each node a multiple of %d workers)", spanning, self.layout.stages)

    def start_fields(self) -> dict:
        return {"pipeline_stages": self.layout.stages, "replicas": self.layout.replicas,
                "micro_batches": self.shape.accum,
                "stage_layers": list(getattr(self, "stage_span", ())),
                "replica_nodes": self.replica_nodes,
                "replicas_spanning_nodes": sum(1 for n in self.replica_nodes if len(n) > 1)}


def _whole_model_params(cfg: GPTConfig) -> int:
    """The parameters of the whole preset (every stage's), as the unpipelined GPT counts them."""
    e, v, s, n = cfg.n_embd, cfg.vocab_size, cfg.seq_len, cfg.n_layer
    block = 2 * 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (4 * e * e + 4 * e) + (4 * e * e + e)
    return v * e + s * e + n * block + 2 * e + e * v
