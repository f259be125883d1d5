"""`train.fsdp=true` under torchrun: the run's parameters, gradients and optimiser state sharded over the ranks with
FSDP2 (`torch.distributed.fsdp.fully_shard`), for models whose training state does not fit one device.

Each block of the model's stack (every element of its outermost `nn.ModuleList`s: ViT's, RoBERTa's, OPT's and
Llama's layers) is one FSDP unit, the rest of the model's parameters (embeddings, a head tied to them) another.
A unit's parameters are gathered for its forward and again for its backward, then freed; each rank keeps a dim-0
shard (a DTensor) of every parameter, its gradient and its Adam moments.

What privacy needs from FSDP, and how it gets it:
- Two-pass clipping (ghost, mixed, fgc, hutch, hutchpp): the first backward forms only per-sample norms. Its
  batch gradients land on the gathered stand-ins of the parameters and are dropped there (`Privatizer`), so FSDP
  reduce-scatters nothing in that pass. The second backward's Σᵢ cᵢ gᵢ is reduce-scattered as a *sum* (the
  divide factor is 1, not FSDP's default mean over ranks).
- Noise: each rank adds N(0, σ²C²) to its own shard of each clipped sum, from a generator of its own (seeded by
  the step's draw of the shared noise generator and the rank), so every coordinate is noised exactly once.
- DP-GRAPE's clipped sums are its small projected matrices: they are all-reduced and noised as without FSDP (one
  shared draw), and each rank lifts the update onto the rows it holds.
- Every rank runs the same number of forward and backward passes (FSDP's collectives pair them up): a rank whose
  part of a Poisson batch has fewer micro-batches runs padding ones whose samples weigh 0 (`Padded`, real = 0).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from dpmem import distributed
from dpmem.data.bundle import real_size


@contextlib.contextmanager
def simulated_ranks(world_size: int):
    """Rank 0 of `world_size` ranks, in this process, with tensors that have shapes but no data: torch's fake
    process group (its collectives do nothing) under FakeTensorMode. FSDP shards, gathers and frees as it would,
    so a memory count sees one rank's tensors. Yields the mesh; tensors made inside are fake."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("ranks are simulated in a process that is not part of a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        ranks = mesh("cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield ranks
    finally:
        dist.destroy_process_group()


def mesh(device_type: str):
    """All ranks, in one dimension: FSDP's device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (distributed.world_size(),))


class Root(nn.Module):
    """FSDP's root unit: the model, with a forward that runs a task's function of it (a loss, a prediction; tasks
    call its parts, `base_model(...)` then `lm_head(...)`, not its forward), so that FSDP gathers the root's
    parameters, and runs its lazy initialisation and end-of-backward work, whatever parts the function calls."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args):
        return fn(self.model, *args)

    def calling(self, fn):
        """`fn(model, batch)` run as this root's forward. A padding batch draws its dropout masks from a copy of the
        random state, so the rank's real batches get the masks they would get without it."""
        def call(model, batch):
            if real_size(batch):
                return self(fn, batch)
            device = next(iter(batch.values())).device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return self(fn, batch)
        return call


def shard_model(model: nn.Module, mesh) -> Root:
    """`fully_shard` every block, then the root, over the `mesh`'s ranks; gradients are reduced as sums. The
    model's parameters become its shards (DTensors); call the model's functions through the returned root."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    stacks: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(s + ".") for s in stacks):
            stacks.append(name)
            for block in module:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mesh=mesh)
    root = fully_shard(Root(model), mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return root


def is_sharded(t) -> bool:
    return isinstance(t, _dtensor())


@functools.cache
def _dtensor() -> type:
    """DTensor, imported on first use (asked per parameter per step: the import statement itself costs)."""
    from torch.distributed.tensor import DTensor
    return DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a view: writing it writes the shard); a plain tensor itself."""
    return t.to_local() if is_sharded(t) else t


def rows(p: torch.Tensor) -> slice:
    """The rows of `p`'s whole shape that this rank's shard holds (FSDP2 shards dim 0 as torch.chunk does)."""
    if not is_sharded(p):
        return slice(None)
    per_rank = -(-p.shape[0] // distributed.world_size())
    start = min(per_rank * distributed.rank(), p.shape[0])
    return slice(start, start + p.to_local().shape[0])


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every rank (a collective); a plain tensor itself."""
    return t.full_tensor() if is_sharded(t) else t


def full_rows(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Every rank's `part` (its rows of a tensor shaped and sharded as `like`), gathered whole (a collective)."""
    return _dtensor().from_local(part, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                 stride=like.stride()).full_tensor()


def model_sharded(model: nn.Module) -> bool:
    return any(is_sharded(p) for p in model.parameters())


# Checkpoints of a sharded run hold whole tensors, written by rank 0 in the one-process format: torch's
# distributed state-dict API gathers them (each parameter in turn, to the CPU) and shards them again on load.
def _whole():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model: nn.Module) -> dict:
    """The whole model's state dict on rank 0 ({} on the others); a collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_whole())


def load_model_state(model: nn.Module, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(model, state, options=_whole())


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimiser's whole state (keyed by parameter names) on rank 0 ({} on the others); a collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=_whole())


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=_whole())
