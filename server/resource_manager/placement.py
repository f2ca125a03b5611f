"""Placement: which devices a slice request gets (the rules are in the package docstring)."""

from __future__ import annotations

from server.resource_manager.models import SliceRequest, _fmt_ids, _Option, _Placement, _Unplaceable
from server.resource_manager.state import RMState


class Placer(RMState):
    """Chooses devices for requests; reads the state, never changes it."""

    def _usable(self, device_id: int, exclusive: bool) -> bool:
        if exclusive:
            return device_id not in self._load
        return device_id not in self._exclusive

    def _load_key(self, device_id: int) -> tuple[int, int]:
        return (self.device_load(device_id), device_id)

    def _pools(self, req: SliceRequest) -> dict[str, list[int]]:
        """Islands matching the filters -> their healthy device ids, sorted (possibly none)."""
        pools: dict[str, list[int]] = {}
        healthy = self._healthy
        for island in [req.island] if req.island is not None else sorted(self._island_devices):
            ids = self._island_devices.get(island)
            if not ids or (req.kind is not None and not self._island_kinds[island].get(req.kind)):
                continue
            pools[island] = [d for d in ids if d in healthy]
        return pools

    def _place(self, req: SliceRequest, prefer: tuple[int, ...] | None) -> _Placement | _Unplaceable:
        """Choose devices for `req` without changing state. The slice being placed must be detached.

        With `prefer` (its previous mapping), keep its still-usable devices in their virtual
        positions and its island when that island can hold the request; otherwise place afresh.
        """
        pools = self._pools(req)
        if req.host_axis is not None:  # its shape over hosts decides; a remap places it afresh
            return self._place_over_hosts(req, pools)
        if prefer is not None and len(prefer) == req.devices:
            kept = self._place_preferring(req, prefer, pools)
            if kept is not None:
                return kept
        n = req.devices
        options: list[_Option] = []
        too_small: list[str] = []
        word = "unshared" if req.exclusive else "usable"
        for island, ids in pools.items():
            usable = sorted((d for d in ids if self._usable(d, req.exclusive)), key=self._load_key)
            if len(usable) < n:
                too_small.append(f"{island} (only {len(usable)} {word})")
                continue
            chosen = usable[:n]
            idle = sum(1 for d in usable if self.device_load(d) == 0)
            total = sum(self.device_load(d) for d in chosen)
            options.append(_Option(island, tuple(sorted(chosen)), total, idle))
        if not options:
            return _Unplaceable(self._capacity_reason(req, pools))
        options.sort(key=_Option.key)
        best = options[0]
        lost: list[str] = []
        for o in options[1:]:
            if o.total_load > best.total_load:
                lost.append(f"{o.island} (total load {o.total_load} > {best.total_load})")
            elif o.idle < best.idle:
                lost.append(f"{o.island} (idle devices {o.idle} < {best.idle})")
            else:
                lost.append(f"{o.island} (tie, name order)")
        loads = [self.device_load(d) for d in best.chosen]
        text = f"island {best.island}: devices {_fmt_ids(best.chosen)} with loads {_fmt_ids(loads)}"
        if req.island is not None:
            text += f"; island {req.island} requested"
        elif lost or too_small:
            text += "; other islands: " + ", ".join(lost + too_small)
        else:
            text += "; the only candidate island"
        return _Placement(best.chosen, text)

    def _place_over_hosts(self, req: SliceRequest, pools: dict[str, list[int]]) -> _Placement | _Unplaceable:
        """A mesh with a host axis: `mesh[host_axis]` hosts, each giving the same number of devices
        (the product of the other axes); virtual device v (row-major over the mesh) is on the host
        of its index along the host axis. Hosts and devices least loaded first."""
        assert req.mesh is not None and req.host_axis is not None
        mesh, axis = req.mesh, req.host_axis
        hosts_needed, per_host = mesh[axis], req.devices // mesh[axis]
        options: list[tuple[int, str, list[list[int]]]] = []
        for island, ids in pools.items():
            by_host: dict[str, list[int]] = {}
            for d in ids:
                if self._usable(d, req.exclusive):
                    by_host.setdefault(self._devices[d].host, []).append(d)
            fits = []
            for host, devs in by_host.items():
                if len(devs) >= per_host:
                    chosen = sorted(devs, key=self._load_key)[:per_host]
                    fits.append((sum(self.device_load(d) for d in chosen), host, sorted(chosen)))
            if len(fits) >= hosts_needed:
                fits.sort()
                picked = fits[:hosts_needed]
                options.append((sum(f[0] for f in picked), island, [f[2] for f in picked]))
        if not options:
            return _Unplaceable(f"needs {hosts_needed} hosts with {per_host} usable devices each on one island "
                                f"(mesh {'x'.join(map(str, mesh))}, host axis {axis})")
        options.sort()
        _, island, groups = options[0]
        mapping = []
        for v in range(req.devices):
            coords = []
            rest = v
            for size in reversed(mesh):
                coords.append(rest % size)
                rest //= size
            coords.reverse()
            within = 0
            for k, (c, size) in enumerate(zip(coords, mesh, strict=True)):
                if k != axis:
                    within = within * size + c
            mapping.append(groups[coords[axis]][within])
        text = (f"island {island}: mesh {'x'.join(map(str, mesh))} with axis {axis} over {hosts_needed} hosts, "
                f"devices {_fmt_ids(mapping)}")
        return _Placement(tuple(mapping), text)

    def _place_preferring(
        self, req: SliceRequest, prefer: tuple[int, ...], pools: dict[str, list[int]]
    ) -> _Placement | None:
        counts: dict[str, int] = {}
        for d in prefer:
            if d in self._devices:
                island = self._devices[d].island
                counts[island] = counts.get(island, 0) + 1
        if not counts:
            return None
        island = min(counts, key=lambda i: (-counts[i], i))
        if island not in pools:
            return None
        usable = [d for d in pools[island] if self._usable(d, req.exclusive)]
        kept = {i: d for i, d in enumerate(prefer) if d in usable}
        spare = sorted((d for d in usable if d not in kept.values()), key=self._load_key)
        free_positions = [i for i in range(req.devices) if i not in kept]
        if len(spare) < len(free_positions):
            return None
        added = sorted(spare[: len(free_positions)])
        mapping = list(prefer)
        for i, d in zip(free_positions, added, strict=True):
            mapping[i] = d
        if not added:
            return _Placement(tuple(mapping), f"island {island}: kept devices {_fmt_ids(prefer)}")
        loads = [self.device_load(d) for d in added]
        text = (
            f"island {island}: kept devices {_fmt_ids(sorted(kept.values()))}, "
            f"added {_fmt_ids(added)} with loads {_fmt_ids(loads)}"
        )
        return _Placement(tuple(mapping), text)

    def _capacity_reason(self, req: SliceRequest, pools: dict[str, list[int]]) -> str:
        """A reason a person can act on for why no island fits `req` (pools from `_pools`)."""
        n = req.devices
        kind = f" {req.kind}" if req.kind else ""
        if req.island is not None:
            healthy = pools.get(req.island, [])
            head = f"island {req.island} has {len(healthy)} healthy{kind} devices"
            if req.exclusive:
                busy = sum(1 for d in healthy if d in self._load)
                need = f"needs {n} unshared"
                return f"{head}, {busy} of them in use; {need}" if busy else f"{head}; {need}"
            held = sum(1 for d in healthy if d in self._exclusive)
            return f"{head}, {held} of them held exclusively; needs {n}" if held else f"{head}; needs {n}"
        if not any(pools.values()):
            return f"needs {n}{kind} devices on one island; no healthy{kind} devices"
        if req.exclusive:
            unshared = {i: sum(1 for d in ids if d not in self._load) for i, ids in pools.items()}
            best = min(unshared, key=lambda i: (-unshared[i], i))
            return (
                f"needs {n} unshared{kind} devices on one island; "
                f"the most any island has is {unshared[best]} (island {best})"
            )
        free = {i: sum(1 for d in ids if d not in self._exclusive) for i, ids in pools.items()}
        best = min(free, key=lambda i: (-free[i], -len(pools[i]), i))
        return (
            f"needs {n}{kind} devices on one island; "
            f"the largest island has {len(pools[best])} (island {best}, {free[best]} free)"
        )

    # ------------------------------------------------------------------------------ transitions
