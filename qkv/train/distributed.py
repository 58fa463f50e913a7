"""Data-parallel training across processes, launched by ``torchrun``.

torchrun starts one process per device and tells each who it is through environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). ``init_from_env``
joins the process group from them: NCCL when CUDA is available (one GPU per process), gloo on CPU.
Without those variables nothing is initialised and training is a single process, as before.

Each optimizer step consumes ``world_size * accumulate`` consecutive batches of the epoch's
shuffled, token-bucketed order; rank r takes every world_size-th of them (``step_share``). Every
rank computes the same order from (seed, epoch), so the shares are disjoint without any
communication, and the step's batches are the same whatever mix of ranks and accumulation reads them.
"""

from __future__ import annotations

import base64
import gc
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from qkv.errors import QkvError

# Rank 0 validates (decodes the validation set) while the others wait in the next collective; give
# it far longer than NCCL's 10-minute default before a wait counts as a hang.
TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class Context:
    """Who this process is in a data-parallel run; the default is a single process on the CPU."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes logs, checkpoints and plots, and shows progress."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """True when a process group exists (torchrun), even with a single process in it."""
        return dist.is_available() and dist.is_initialized()

    @property
    def parallel(self) -> bool:
        """True when there are other processes to talk to; collectives are no-ops otherwise."""
        return self.world_size > 1 and self.enabled


def launched_by_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    return "RANK" in environ and "WORLD_SIZE" in environ


def init_from_env(environ: Mapping[str, str] = os.environ) -> Context:
    """Join the process group described by torchrun's variables; a plain single process without them."""
    if not launched_by_torchrun(environ):
        return Context()
    if not dist.is_available():
        raise QkvError("this PyTorch build has no torch.distributed: cannot train under torchrun")
    if not dist.is_initialized():
        if torch.cuda.is_available():
            # One GPU per process: LOCAL_RANK is this process's index on its machine.
            torch.cuda.set_device(int(environ.get("LOCAL_RANK", 0)))
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, timeout=TIMEOUT)
    return current()


def current() -> Context:
    """The context of the process group this process is in (a single CPU process when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Context()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return Context(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def shutdown(*, clean: bool = True) -> None:
    """Leave the process group.

    After a clean finish (``clean``), first free what still holds the group (a DDP wrapper caught in a
    reference cycle would otherwise be destroyed during interpreter shutdown, with the group's threads
    still running) and wait for every rank: a rank that closes its connections while another still
    uses them can abort that one ("terminate called without an active exception"). After an error
    there is no waiting: the other ranks may never arrive.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def step_share(
    batches: Sequence[list[int]], position: int, *, rank: int, world_size: int, accumulate: int
) -> tuple[list[list[int]], int]:
    """This rank's micro-batches for the optimizer step that starts at ``batches[position]``, and how
    many of the epoch's batches that step uses on all ranks together.

    The step takes the next ``world_size * accumulate`` batches; rank r gets those at r, r + world_size,
    ... At the end of an epoch a step may be short; when it has fewer batches than ranks, some rank
    would have nothing to contribute, so the step is dropped: ``([], 0)``, and the epoch ends.
    """
    group = batches[position : position + world_size * accumulate]
    if len(group) < world_size:
        return [], 0
    return group[rank::world_size], len(group)


def all_reduce_sum(values: Tensor, ctx: Context) -> Tensor:
    """The element-wise sum of ``values`` over all ranks (``values`` itself in a single process)."""
    if ctx.parallel:
        values = values.to(ctx.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_rank(flags: list[bool], ctx: Context) -> list[bool]:
    """Each flag, true on every rank when it is true on any rank (decisions that must not diverge)."""
    if not ctx.parallel:
        return [bool(f) for f in flags]
    return [bool(n > 0) for n in all_reduce_sum(torch.tensor([float(f) for f in flags]), ctx).tolist()]


def broadcast_value(value: float, ctx: Context) -> float:
    """Rank 0's ``value`` on every rank (a clock reading, so that time-based decisions agree)."""
    if not ctx.parallel:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    dist.broadcast(tensor, src=0)
    return float(tensor.item())


def broadcast_flag(flag: bool, ctx: Context) -> bool:
    """Rank 0's ``flag`` on every rank."""
    if not ctx.parallel:
        return bool(flag)
    value = torch.tensor([float(flag)], device=ctx.device)
    dist.broadcast(value, src=0)
    return bool(value.item() > 0)


def barrier(ctx: Context) -> None:
    if not ctx.parallel:
        return
    if ctx.device.type == "cuda":
        dist.barrier(device_ids=[ctx.device.index])  # NCCL wants to know the GPU; else it guesses and warns
    else:
        dist.barrier()


def rng_state(ctx: Context) -> dict[str, str]:
    """This process's random generator states (CPU, and CUDA on a GPU), as base64 text for JSON."""
    states = {"cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return {name: base64.b64encode(state.numpy().tobytes()).decode("ascii") for name, state in states.items()}


def set_rng_state(states: Mapping[str, str], ctx: Context) -> None:
    def decode(text: str) -> Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(states["cpu"]))
    if "cuda" in states and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(decode(states["cuda"]), ctx.device)


def gather_rng_states(ctx: Context) -> list[dict[str, str]]:
    """Every rank's generator states, in rank order (on all ranks), so a resumed run draws on."""
    mine = rng_state(ctx)
    if not ctx.parallel:
        return [mine]
    states: list[dict[str, str] | None] = [None] * ctx.world_size
    dist.all_gather_object(states, mine)
    return [s for s in states if s is not None]


def no_buffer_sync() -> dict[str, bool]:
    """DDP's option not to re-send buffers before every forward: the model's only buffer is the
    constant positional table. Newer PyTorch calls it forward_sync_buffers (broadcast_buffers warns)."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def rank_seed(seed: int, rank: int, step: int) -> int:
    """A seed for one rank's dropout, distinct per (seed, rank, step)."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % 2**63
