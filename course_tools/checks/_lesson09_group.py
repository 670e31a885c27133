"""Stand-in devices of a multi-process group for lesson 09's checkers: a ``jax.Device``'s ``id`` and
``process_index`` without the process (:class:`FakeDevice`), and one JAX's index maps ask for
addressability, process 0's being this process's (:class:`GroupDevice`)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands for a ``jax.Device`` of a multi-process run: a global ``id`` and the ``process_index`` owning it."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"

    def __repr__(self) -> str:
        return f"dev{self.id}@p{self.process_index}"


def fake_devices(
    n_processes: int, local: int, interleave: bool = True, seed: int = 0, ids: str = "grouped"
) -> list[FakeDevice]:
    """``n_processes × local`` stand-in devices; ``interleave`` lists them round-robin over processes and
    shuffles each process's ids (a listing order a launcher or a sort by another key can give you).

    ``ids``: ``"grouped"`` — process ``p``'s ids are ``p·1000 + k`` (sorting by id alone then groups the
    processes, as on most GPU clusters); ``"interleaved"`` — device ``k`` of process ``p`` has id
    ``k·n_processes + p`` (consecutive ids on different processes); ``"random"`` — a random permutation of
    ``0 … n_processes·local − 1``. Only the last two tell a sort by ``(process_index, id)`` from a sort by
    id."""
    rng = np.random.default_rng(seed)
    n = n_processes * local
    shuffled = rng.permutation(n)

    def id_of(p: int, k: int) -> int:
        if ids == "interleaved":
            return k * n_processes + p
        if ids == "random":
            return int(shuffled[p * local + k])
        return p * 1000 + k

    per = [
        [FakeDevice(id_of(p, int(k)), p) for k in rng.permutation(local)]
        for p in range(n_processes)
    ]
    if not interleave:
        return [d for devs in per for d in sorted(devs, key=lambda d: d.id)]
    return [per[p][k] for k in range(local) for p in range(n_processes)]


class _Client:
    def process_index(self) -> int:  # the process the check plays: 0
        return 0


@dataclasses.dataclass(frozen=True)
class GroupDevice(FakeDevice):
    """A :class:`FakeDevice` JAX can ask for addressability: process 0's devices are this process's."""

    @property
    def client(self) -> _Client:
        return _Client()
