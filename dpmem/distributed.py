"""One run on several processes (`torchrun --nproc_per_node=N -m dpmem train ...`): torch.distributed's process
group, each rank's device, and the few collectives the methods need. With one process every function here is a
no-op, so a single-process run is unchanged.

What the ranks share and what they split:
- Every rank composes the same config, builds the same model from the same seed and draws the same logical batch
  (from rank 0's key); rank r trains on positions r, r+N, r+2N, ... of it (`shard`). The batch is the one a
  single process would draw, so the accountant sees the same q and steps.
- Private methods all-reduce their clipped sums (grape: its r-dimensional projected sums), and every rank then
  adds the same Gaussian draw (one key, rank 0's), so N(0, σ²C²) enters the aggregate once, as in a single
  process, and the ranks stay identical replicas without a second collective.
- Non-private methods all-reduce their summed gradients; zeroth-order methods all-reduce scalars only.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

BUCKET_BYTES = 32 << 20  # tensors all-reduced together, flattened into buffers of about this size


class PeerFailure(RuntimeError):
    """A collective failed: another rank died (its connection closed) or the group was torn down."""


@contextlib.contextmanager
def _collective():
    try:
        yield
    except RuntimeError as e:  # gloo's and NCCL's errors are RuntimeErrors (DistBackendError among them)
        raise PeerFailure(f"another rank failed or stopped ({str(e).splitlines()[0]})") from e


class Traffic:
    """Bytes this process has all-reduced (the payload handed to the collective), for the communication bench."""
    bytes = 0


def launched() -> bool:
    """Started by torchrun (or anything that sets its variables) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env() -> None:
    """Join the process group torchrun describes: gloo for CPU tensors, NCCL for CUDA ones. Each rank uses the GPU
    of its LOCAL_RANK, so that torch.device("cuda") means that GPU. With more ranks per node than GPUs (a CPU run)
    every rank joins with gloo alone: the ranks must agree on their backends."""
    if not launched() or dist.is_initialized():
        return
    backend = "gloo"
    if local_gpu() is not None:
        torch.cuda.set_device(local_gpu())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))


def local_gpu() -> int | None:
    """The GPU of this rank (its LOCAL_RANK), if the node has one for each of its ranks; else None."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available() or ranks > torch.cuda.device_count():
        return None
    return int(os.environ.get("LOCAL_RANK", "0"))


def settle() -> None:
    """At a normal end, before `close`: every rank's collectives done. gloo's worker threads let go of a collective
    after wait() returns; a process group torn down while one still runs aborts the process ("terminate called
    without an active exception") after its work is saved, and torchrun then reports the run failed."""
    if dist.is_initialized():
        with _collective():
            dist.barrier()


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def backend() -> str | None:
    return str(dist.get_backend()) if dist.is_initialized() else None


def shard(index: torch.Tensor) -> torch.Tensor:
    """This rank's part of a logical batch: disjoint, covering it, and at most one smaller than another rank's."""
    return index[rank()::world_size()] if dist.is_initialized() else index


def sum_(tensors) -> None:
    """All-reduce (sum) the tensors in place across ranks, in flat buckets of about BUCKET_BYTES."""
    if world_size() == 1:
        return
    bucket, size = [], 0
    for t in tensors:
        bucket.append(t)
        size += t.numel() * t.element_size()
        if size >= BUCKET_BYTES:
            _reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(bucket: list[torch.Tensor]) -> None:
    groups: dict[tuple, list[torch.Tensor]] = {}  # one flat buffer per device and dtype
    for t in bucket:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for same in groups.values():
        alone = len(same) == 1 and same[0].is_contiguous()  # a large tensor is reduced where it is, not copied
        flat = same[0] if alone else torch.cat([t.reshape(-1) for t in same])
        Traffic.bytes += flat.numel() * flat.element_size()
        with _collective():
            dist.all_reduce(flat)
        if alone:
            continue
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def total(count: int) -> int:
    """`count` summed over ranks (a host-side integer: how many samples the logical batch has)."""
    return _reduced(count, "SUM")


def most(count: int) -> int:
    """The largest `count` over ranks (how many micro-batches the fullest part of a logical batch has)."""
    return _reduced(count, "MAX")


def _reduced(count: int, op: str) -> int:
    if world_size() == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64)
    with _collective():
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t)


def reduce_gradients(params) -> None:
    """Sum `.grad` over ranks; a rank that saw no sample (an empty part of a Poisson batch) adds zeros."""
    if world_size() == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sum_(p.grad for p in params)


def from_main(obj):
    """Rank 0's value of a picklable object (a seed, a timestamp, a decision), on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    with _collective():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gathered(obj) -> list:
    """Every rank's value of a picklable object, in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    with _collective():
        dist.all_gather_object(out, obj)
    return out
