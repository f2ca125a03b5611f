"""Where a proxy session's buffers live on the workers of its slice (cluster_backend.py).

Pure bookkeeping, no I/O. A buffer has a home (the worker holding it, or the first of those that
do); an upload replicated over devices of several workers is a whole copy on each (`copies`); a
result of an SPMD computation over several workers leaves a part on each (`others`: the workers
besides its home), known for the slice's placement of the run that made it only (`placed_at`),
with the virtual devices its parts are on and its spec (`spread`), so that a run over other
devices reads it through a gathered copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .backend import ArraySpec, BackendError


@dataclass
class Holdings:
    home: dict[int, str] = field(default_factory=dict)  # buffer id -> the address of the worker holding it
    # an upload replicated over devices of several workers -> the workers holding a whole copy
    # (the first is its home): a run on some of them reads their own copies (`input_home`)
    copies: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # a result left in parts on several workers -> the other workers holding parts
    others: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # such a buffer -> the slice's generation (remaps) when it was made: where its parts are is
    # known for that placement only (`check_placed`)
    placed_at: dict[int, int] = field(default_factory=dict)
    # buffer -> (the virtual devices its parts are on, as a set and in order, its spec): a result
    # of a program over several workers of a slice spanning hosts, each holding only its own part
    spread: dict[int, tuple[frozenset[int], tuple[int, ...], ArraySpec]] = field(default_factory=dict)

    def address_of(self, buffer_id: int) -> str:
        address = self.home.get(buffer_id)
        if address is None:
            raise BackendError("NOT_FOUND", f"buffer {buffer_id} is not this session's")
        return address

    def made(self, outputs: Sequence[int], address: str, others: tuple[str, ...], generation: int) -> None:
        """A run on `address` (and `others`: its gang's other members, whose parts go when the
        buffer does) made `outputs`."""
        for b in outputs:
            self.home[b] = address
        if others:
            for b in outputs:
                self.others[b] = others
                self.placed_at[b] = generation

    def stored(self, ids: Sequence[int], addresses: Sequence[str]) -> None:
        """Uploads `ids` stored on each of `addresses` (the first their home; several: copies)."""
        for b in ids:
            self.home[b] = addresses[0]
            if len(addresses) > 1:
                self.copies[b] = tuple(addresses)

    def input_home(self, buffer_id: int, home: str, workers: tuple[str, ...]) -> str:
        """Where a run on `workers` finds an input (`RunProgram.input_homes`; several: "a|b", each
        member reads its own, nothing is sent): a copy held by each of them is read where it is,
        and so is a result spread over exactly those workers (each holds its part under the
        buffer's id); else its `home`, which sends it to the others."""
        copies = self.copies.get(buffer_id)
        if copies is not None:
            return "|".join(workers) if all(w in copies for w in workers) else home
        others = self.others.get(buffer_id)
        if others is not None and len(workers) > 1 and set(workers) == {home, *others}:
            return "|".join(workers)
        return home

    def check_placed(self, inputs: Sequence[int], generation: int, slice_name: str) -> None:
        """Refuses inputs whose parts were left on several workers under an earlier placement
        of the slice: after a remap, a run (or the gather a download runs) would look for them on
        the devices their virtual devices map to now, and get parts of another array or none."""
        for b in inputs:
            made = self.placed_at.get(b)
            if made is not None and made != generation:
                raise BackendError(
                    "FAILED_PRECONDITION",
                    f"array {b}: its parts were on several workers of slice {slice_name} before the slice was "
                    f"re-placed (remap: generation {made} -> {generation}); it cannot be read any more, compute "
                    f"it again")

    def forget(self, buffer_ids: Sequence[int]) -> dict[str, list[int]]:
        """Forgets the buffers; the ids each worker holds (a home, a part, a copy) to release."""
        by_worker: dict[str, list[int]] = {}
        for b in buffer_ids:
            self.spread.pop(b, None)
            self.placed_at.pop(b, None)
            address = self.home.pop(b, None)
            if address is not None:
                by_worker.setdefault(address, []).append(b)
                for other in self.others.pop(b, ()):
                    by_worker.setdefault(other, []).append(b)
                for other in self.copies.pop(b, (address,)):
                    if other != address:
                        by_worker.setdefault(other, []).append(b)
        return by_worker

    def clear(self) -> None:
        self.home.clear()
        self.copies.clear()
