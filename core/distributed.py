"""Where one rank sits in a tensor × pipeline parallel instance, and the collectives it runs.

Ranks are numbered stage-major: ``rank = pp_rank * tp_size + tp_rank``. The ``tp_size`` ranks of
one pipeline stage form its tensor-parallel group (they all-reduce the outputs of row-parallel
layers and gather the vocabulary shards of the logits); rank ``r`` of stage ``s`` sends its
hidden states to rank ``r`` of stage ``s + 1`` (every rank of a stage holds the whole hidden
state after the all-reduce). The *driver* — tensor rank 0 of the last stage — samples and
answers the engine::

    tp=2, pp=2:   stage 0: ranks 0 1   (embedding, layers 0 .. L/2-1)
                  stage 1: ranks 2 3   (layers L/2 .. L-1, final norm, LM head; rank 2 samples)

The model layers read the context when they are built (``current()``): a process that never
calls ``set_current`` is a single rank (tp = pp = 1), where every collective is a no-op, so the
"uniproc" executor pays nothing for this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class ParallelContext:
    """One rank's place and its process groups (None when that dimension has size 1)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None
    pp_group: Any = None
    """The group p2p sends between stages use (the world group)."""
    cpu_group: Any = None
    """A gloo group of every rank, for what travels on the CPU (block counts, step messages)."""

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and answers the engine: tensor rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def driver_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    # ------------------------------------------------------------------ partitions

    def stage_layers(self, num_layers: int) -> range:
        """The contiguous layers of this rank's stage (earlier stages take one more when the
        layers do not divide evenly)."""
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    def kv_head_split(self, num_kv_heads: int) -> tuple[int, int]:
        """(parts, index) of the KV heads this rank holds: split ``tp`` ways, or — with fewer KV
        heads than ranks — whole heads replicated on ``tp / num_kv_heads`` ranks each."""
        if num_kv_heads >= self.tp_size:
            return self.tp_size, self.tp_rank
        return num_kv_heads, self.tp_rank * num_kv_heads // self.tp_size

    def num_local_kv_heads(self, num_kv_heads: int) -> int:
        return num_kv_heads // self.kv_head_split(num_kv_heads)[0]

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place (a no-op at tp = 1)."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every tensor rank's ``x`` along the last dimension on tensor rank 0; the
        other ranks get None (x at tp = 1)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(x, parts, group=self.tp_group, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send_next(self, x: torch.Tensor) -> Any:
        """Start sending ``x`` to the same tensor rank of the next stage; returns the work
        handle to ``wait()`` on."""
        import torch.distributed as dist

        return dist.isend(x.contiguous(), self.rank + self.tp_size, group=self.pp_group)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive a tensor of ``shape`` from the same tensor rank of the previous stage."""
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, self.rank - self.tp_size, group=self.pp_group)
        return x


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Layers of stage ``pp_rank`` of ``pp_size`` contiguous stages (earlier stages take the
    remainder): 10 layers in 3 stages → 0-3, 4-6, 7-9."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size = {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_tensor_parallel(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError when attention heads or KV heads cannot be shared by ``tp_size`` ranks."""
    if tp_size == 1:
        return
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size = {tp_size} does not divide the model's "
                         f"{num_heads} attention heads")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size = {tp_size} does not divide the model's "
                         f"{num_kv_heads} KV heads")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"the model's {num_kv_heads} KV heads cannot be replicated evenly over "
                         f"tensor_parallel_size = {tp_size} ranks (it must be a multiple of them)")


_current = ParallelContext()


def current() -> ParallelContext:
    """The context of this process (a single rank unless a worker set one)."""
    return _current


def set_current(context: ParallelContext) -> None:
    global _current
    _current = context
