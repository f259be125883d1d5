"""Secret randomness: what an adversary must not predict (which steps held a record, the noise, the estimators'
probes, FSDP's shard noise) is drawn from a 256-bit key, the OS's (or a user's seed, taken whole), never from a
seeded torch.Generator: the CPU one (Mersenne twister) keeps the low 32 bits of its seed, the CUDA one (Philox) a
64-bit key, and a search over 2³² seeds singled out a run's batches from the sums its folder logged.

Draws are keyed, not streamed: the i-th draw of a purpose is a function of (key, purpose, i) alone, its own key
derived by BLAKE2b. A checkpoint keeps the key and the count, whatever the device; a draw neither depends on nor
advances any other.
- On the CPU a draw is numpy's PCG64DXSM (128-bit state, 128-bit increment) seeded with the draw's 256-bit key.
- On CUDA it is the sum of two Philox streams, each keyed with 64 of those bits, over √2: exactly standard normal,
  128 bits of key (one Philox stream has a 64-bit key and a 62-bit offset: 126 at most).
- On meta nothing is drawn: the values are meta tensors of the same shape."""

from __future__ import annotations

import contextlib
import hashlib
import math
import secrets

import numpy as np
import torch

from dpmem import distributed

KEY_BYTES = 32
CUDA_NOISE_CHUNK = 2**22  # elements of the second Philox stream drawn at once on a GPU (16 MiB in float32)


def os_key() -> bytes:
    """256 bits of the OS's entropy, rank 0's on every rank (every rank draws the same batches and noise)."""
    return distributed.from_main(secrets.token_bytes(KEY_BYTES))


def seed_key(seed: int) -> bytes:
    """A user's seed as a key, every bit of it (5 and 5 + 2³² are different keys): reproducible, not secret."""
    return hashlib.blake2b(str(int(seed)).encode(), digest_size=KEY_BYTES, person=b"dpmem.seed").digest()


def key_of(seed: int | None) -> bytes:
    """The key of a run's draws: from `seed` when one is given, else from the OS."""
    return os_key() if seed is None else seed_key(seed)


def derive(key: bytes, purpose: str, index: int = 0) -> bytes:
    """The key of draw `index` of `purpose`: BLAKE2b keyed by `key` (a pseudo-random function of 256-bit key)."""
    return hashlib.blake2b(f"{purpose}/{index}".encode(), key=key, digest_size=KEY_BYTES).digest()


class Draws:
    """The draws of one purpose, each keyed by (key, purpose, count): `numpy()` a generator for host-side sampling,
    `randn` standard normal values on `device`. `count` is all the state there is."""

    def __init__(self, key: bytes, purpose: str, device: torch.device | str = "cpu", count: int = 0):
        if len(key) < 16:
            raise ValueError(f"a key of {8 * len(key)} bits: at least 128 are needed")
        self.key, self.purpose, self.device, self.count = key, purpose, torch.device(device), count

    def next_key(self) -> bytes:
        key = derive(self.key, self.purpose, self.count)
        self.count += 1
        return key

    def numpy(self) -> np.random.Generator:
        """A generator for the next draw (the batch sampler's: rates compared with uniforms on the host)."""
        return np.random.Generator(np.random.PCG64DXSM(int.from_bytes(self.next_key(), "little")))

    def child(self, purpose: str) -> "Draws":
        """The draws of a sub-purpose keyed by this one's next draw (a step's probes, a rank's shard noise)."""
        return Draws(self.next_key(), purpose, self.device)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal values of `shape` on the device (float64 drawn as float64; other dtypes drawn in
        float32 and rounded)."""
        key = self.next_key()
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        if self.device.type == "meta":
            return torch.empty(shape, device="meta", dtype=dtype)
        if self.device.type == "cpu":
            rng = np.random.Generator(np.random.PCG64DXSM(int.from_bytes(key, "little")))
            z = torch.from_numpy(rng.standard_normal(math.prod(shape), dtype=np.float64 if wide == torch.float64
                                                     else np.float32)).view(shape)
        else:
            first, second = (torch.Generator(device=self.device).manual_seed(int.from_bytes(key[i:i + 8], "little"))
                             for i in (0, 8))
            z = torch.randn(shape, generator=first, device=self.device, dtype=wide)
            # the second stream added a chunk at a time: a whole second draw would be a transient as large as the
            # noise (the largest parameter's), which the memory plan (one buffer, as the CPU draws) does not hold
            flat = z.view(-1)
            for start in range(0, flat.numel(), CUDA_NOISE_CHUNK):
                part = flat[start:start + CUDA_NOISE_CHUNK]
                part.add_(torch.randn(part.shape, generator=second, device=self.device, dtype=wide))
            z.mul_(math.sqrt(0.5))
        return z if z.dtype == dtype else z.to(dtype)

    def state_dict(self) -> dict:
        """The key (hex: a checkpoint loads with weights_only) and the count: keep it as private as the data."""
        return {"key": self.key.hex(), "purpose": self.purpose, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.purpose, self.count = bytes.fromhex(state["key"]), state["purpose"], state["count"]


@contextlib.contextmanager
def rewound(draws: Draws | None):
    """What is drawn inside not kept: the count put back after (a compiled run's rehearsal draws what its step will
    draw again)."""
    count = draws.count if draws is not None else None
    try:
        yield
    finally:
        if draws is not None:
            draws.count = count


def normal(draws: Draws | None, shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values from `draws`, or torch's global generator where there are none (plans, benchmarks)."""
    if draws is None:
        return torch.randn(shape, device=device, dtype=dtype)
    return draws.randn(*shape, dtype=dtype)


class Recorded:
    """Draws that note each draw's shape and dtype: the order in which a step draws its probes, so that a compiled
    step can be given them (`Drawn`)."""

    def __init__(self, draws: Draws):
        self.draws, self.shapes = draws, []

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self.shapes.append((shape, dtype))
        return self.draws.randn(*shape, dtype=dtype)


class Drawn:
    """Draws made already (on the host, from the secret key, outside a compiled graph), handed out in order: the
    graph never holds a key or a generator, and each step is given fresh values."""

    def __init__(self, values: list[torch.Tensor]):
        self.values, self.count = values, 0

    @classmethod
    def of(cls, draws: Draws, shapes: list) -> "Drawn":
        """The draws `draws` makes for these (shape, dtype) in order, made now."""
        return cls([draws.randn(*shape, dtype=dtype) for shape, dtype in shapes])

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The next draw, which must be of the shape and dtype asked for: a draw meant for another use is an error,
        not a silent swap."""
        value = self.values[self.count]
        if tuple(value.shape) != shape or value.dtype != dtype:
            raise RuntimeError(f"draw {self.count} was made as {tuple(value.shape)} {value.dtype}, and is asked for as "
                               f"{shape} {dtype}: the draws are handed out in another order than they were made in")
        self.count += 1
        return value

