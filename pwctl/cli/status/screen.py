"""The status screen: one `ClusterStatus` drawn to fit a terminal of `width` x `height`.

Most important first: the cluster line; gangs held back by a host (red, with the host and for
how long); islands with utilization and their queues' counts; what each device runs now
(devices of one host doing the same thing share a row); jobs; then the longest waits. Every
row is one line (cells end in '…' rather than wrap), and sections that do not fit whole end
with "... and N more" (layout.py decides how many rows each gets). `-o json` carries all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from schemas.views import ClusterStatusView, DeviceStatusView, IslandStatusView, QueueEntryView

from ..common import age
from .layout import Section, allocate

BUSY_WITHIN_S = 1.0  # a device that finished a node this recently is shown as running it
NARROW = 100  # below this width, narrower bars and fewer columns


def bar(fraction: float, width: int = 12) -> Text:
    """A utilization bar with its percentage: '██████░░░░░░  50%'."""
    fraction = min(1.0, max(0.0, fraction))
    full = round(fraction * width)
    style = "green" if fraction < 0.5 else "yellow" if fraction < 0.9 else "red"
    text = Text("█" * full, style=style)
    text.append("░" * (width - full), style="dim")
    text.append(f" {fraction * 100:3.0f}%")
    return text


def seconds(s: float) -> str:
    """'4.2s', '75s', '12m', '3h'."""
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


def count(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    start = prev = None
    for v in values:
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


@dataclass
class DeviceGroup:
    """Devices of one host, next to each other, in the same state running the same thing."""

    host: str
    island: str
    host_state: str
    running: str
    job: str
    devices: list[DeviceStatusView]

    @property
    def utilization(self) -> float:
        return sum(d.utilization for d in self.devices) / len(self.devices)

    @property
    def idle_s(self) -> float:
        return min(d.idle_s for d in self.devices)


def device_groups(devices: Iterable[DeviceStatusView]) -> list[DeviceGroup]:
    groups: list[DeviceGroup] = []
    for d in devices:
        g = groups[-1] if groups else None
        if (g is not None and g.host == d.host and g.running == d.running and g.job == d.job
                and g.host_state == d.host_state and g.devices[-1].local_index + 1 == d.local_index):
            g.devices.append(d)
        else:
            groups.append(DeviceGroup(d.host, d.island, d.host_state, d.running, d.job, [d]))
    return groups


def _by_run(s: ClusterStatusView, keep: Callable[[QueueEntryView], bool]) -> list[tuple[str, QueueEntryView]]:
    """(islands, entry) of the queue entries `keep` selects: a gang over several islands is in
    each island's queue, and here once, its islands joined by ','."""
    islands: dict[int, list[str]] = {}
    entries: dict[int, QueueEntryView] = {}
    for q in s.queues:
        for e in q.entries:
            if keep(e):
                islands.setdefault(e.run_id, []).append(q.island)
                entries.setdefault(e.run_id, e)
    return [(",".join(islands[rid]), e) for rid, e in entries.items()]


def stuck(s: ClusterStatusView) -> list[tuple[str, QueueEntryView]]:
    """(islands, entry) of every gang held back by a host, the longest held first."""
    return sorted(_by_run(s, lambda e: bool(e.stalled_host)), key=lambda x: -x[1].stalled_s)


@dataclass
class WaitGroup:
    """Waiting gangs of one program and job, on the same islands, waiting for the same reason
    (a client's pipelined runs wait behind each other): one row. `entry` is the longest waiting."""

    islands: str
    entry: QueueEntryView
    runs: int = 1


def waits(s: ClusterStatusView) -> list[WaitGroup]:
    """The waiting gangs, grouped, the group that has waited longest first."""
    groups: dict[tuple[str, str, str, str, int], WaitGroup] = {}
    for islands, e in sorted(_by_run(s, lambda e: e.state == "waiting"), key=lambda x: -x[1].waiting_s):
        key = (islands, e.program, e.job, e.reason, e.priority)
        if key in groups:
            groups[key].runs += 1
        else:
            groups[key] = WaitGroup(islands, e)
    return list(groups.values())


def cluster_lines(s: ClusterStatusView, width: int, address: str = "") -> list[Text]:
    """The cluster line, broken between its parts to fit `width`."""
    isl = s.island_status
    hosts_ready = sum(i.hosts_ready for i in isl)
    stalled = sum(i.hosts_stalled for i in isl)
    devices = sum(i.devices for i in isl)
    available = sum(i.devices_available for i in isl)
    util = sum(i.utilization * i.devices for i in isl) / devices if devices else 0.0
    parts: list[Text] = [Text(f"{address + ' ' if address else ''}{s.at[11:19]}Z", style="bold")]
    parts.append(Text(count(len(isl), "island")))
    hosts = Text(f"hosts {hosts_ready:,}/{s.hosts_total:,} ready")
    if stalled:
        hosts.append(f", {stalled:,} stalled", style="bold red")
    parts += [hosts, Text(f"devices {available:,}/{devices:,} up"), Text(f"util {util * 100:.0f}%", style="bold")]
    parts.append(Text(f"{s.computations_per_s:,.0f} computations/s", style="bold"))
    parts.append(Text(f"jobs {s.jobs_running} running"))
    lines: list[Text] = []
    line = Text()
    for p in parts:
        sep = " · " if line.plain else ""
        if line.plain and len(line.plain) + len(sep) + len(p.plain) > width:
            lines.append(line)
            line, sep = Text(), ""
        line.append(sep)
        line.append_text(p)
    lines.append(line)
    return lines


class Grid:
    """A table whose rows are one line each at `width`: columns take their natural width, and
    when the whole is too wide the `flex` columns (free text) give way first, cut with '…'."""

    def __init__(self, width: int, *columns: tuple[str, dict[str, object]]) -> None:
        self.width = width
        self.columns = columns
        self.rows: list[tuple[RenderableType, ...]] = []

    def add_row(self, *cells: RenderableType) -> None:
        self.rows.append(cells)

    def widths(self) -> list[int]:
        natural = []
        for k, (name, opts) in enumerate(self.columns):
            w = max([len(name)] + [Text(c).cell_len if isinstance(c, str) else
                                   c.cell_len if isinstance(c, Text) else 4 for c in (r[k] for r in self.rows)])
            natural.append(min(w, int(opts.get("max", w))))  # type: ignore[call-overload]
        widths = list(natural)
        room = self.width - 2 * (len(widths) - 1)
        flex = [k for k, (_, opts) in enumerate(self.columns) if opts.get("flex")]
        for pool, floor in ((flex, 6), (range(len(widths)), 3)):
            while sum(widths) > room and pool:
                k = max(pool, key=lambda k: widths[k])
                if widths[k] <= floor:
                    break
                widths[k] -= 1
        return widths

    def table(self) -> Table:
        t = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
        for (name, opts), w in zip(self.columns, self.widths(), strict=True):
            t.add_column(name, no_wrap=True, overflow="ellipsis", width=w, min_width=w, max_width=w,
                         justify=opts.get("justify", "left"))  # type: ignore[arg-type]
        for r in self.rows:
            t.add_row(*r)
        return t


def _more(n: int, what: str, extra: str = "") -> Text:
    return Text(f"... and {count(n, 'more ' + what)}{extra}", style="dim")


def render(s: ClusterStatusView, width: int = 80, height: int | None = None, address: str = "") -> RenderableType:
    """The screen for `s`: at most `height` lines (None: everything the update holds), none
    wider than `width`."""
    head = cluster_lines(s, width, address)
    stuck_entries = stuck(s)
    groups = device_groups(s.devices)
    wait_entries = waits(s)
    # a section whose update holds only part of it (a device page, a queue limit) always keeps a
    # line for "... and N more": one item more than it can show
    partial = len({d.host for d in s.devices}) < s.hosts_total or len(s.devices) < s.devices_total
    waiting = sum(q.waiting for q in s.queues)
    listed = sum(g.runs * len(g.islands.split(",")) for g in wait_entries)  # counted per island queue
    sections = [
        Section("stuck", len(stuck_entries), first=2, height=2, header=0),
        Section("islands", len(s.island_status), first=4),
        Section("devices", len(groups) + (1 if partial and groups else 0), first=4),
        Section("jobs", len(s.jobs), first=3),
        Section("slices", len(s.slices), first=2),
        Section("waits", len(wait_entries) + (1 if waiting > listed else 0), first=2),
    ]
    left = allocate(sections, None if height is None else height - len(head),
                    ["devices", "jobs", "islands", "slices", "waits", "stuck"])
    shown = [sec for sec in sections if sec.total]
    gap = height is None or left >= len(shown)  # blank lines between sections when there is room

    parts: list[RenderableType] = list(head)
    for sec in sections:
        if not sec.total:
            continue
        if gap:
            parts.append(Text(""))
        parts += _SECTIONS[sec.name](s, sec, width, stuck_entries, groups, wait_entries)
    if not s.devices and not s.island_status:
        parts.append(Text("no devices: no worker has registered (`pwctl worker start`, or `pwctl up`)"))
    return Group(*parts)


def _stuck(s: ClusterStatusView, sec: Section, width: int, entries: list[tuple[str, QueueEntryView]],
           *_: object) -> list[RenderableType]:
    out: list[RenderableType] = []
    if sec.shown == 0:
        return [Text(f"STUCK: {count(sec.total, 'gang')} held back by a host (`pwctl status -o json`)",
                     style="bold red")]
    for island, e in entries[: sec.shown]:
        job = f" of {e.job}" if e.job else ""
        where = f"island{'s' if ',' in island else ''} {island}"
        line = Text(f"STUCK for {seconds(e.stalled_s)}: host {e.stalled_host} holds back {e.program}{job} on {where}",
                    style="bold red", no_wrap=True, overflow="ellipsis")
        out += [line, Text(f"  {e.reason}", style="red", no_wrap=True, overflow="ellipsis")]
    if sec.hidden:
        out.append(_more(sec.hidden, "stuck gang"))
    return out


def _islands(s: ClusterStatusView, sec: Section, width: int, *_: object) -> list[RenderableType]:
    queues = {q.island: q for q in s.queues}
    if sec.shown == 0:
        return [Text(f"islands: {len(s.island_status)}", style="bold")]
    narrow = width < NARROW
    t = Grid(width, ("ISLAND", {"flex": True}), ("HOSTS", {"justify": "right"}), ("DEVICES", {"justify": "right"}),
             ("UTIL", {}), ("RUNS", {"justify": "right"}), ("WAITING", {"justify": "right"}),
             ("LONGEST", {"justify": "right"}), *((("POLICY", {}),) if not narrow else ()))
    rows: list[IslandStatusView] = s.island_status[: sec.shown]
    for i in rows:
        q = queues.get(i.name)
        hosts = Text(f"{i.hosts_ready}/{i.hosts}")
        if i.hosts_stalled:
            hosts = Text(f"{i.hosts_stalled}!" if narrow else f"{i.hosts_stalled} stalled ", style="bold red") + hosts
        cells: list[RenderableType] = [
            i.name, hosts, f"{i.devices_available}/{i.devices}", bar(i.utilization, 6 if narrow else 12),
            Text(str(q.running if q else 0) + ((f" ({q.stalled}!)" if narrow else f" ({q.stalled} stuck)")
                                                 if q and q.stalled else ""),
                 style="red" if q and q.stalled else ""),
            str(q.waiting if q else 0), seconds(q.longest_wait_s) if q and q.waiting else "-"]
        if not narrow:
            cells.append(q.policy if q else "-")
        t.add_row(*cells)
    out: list[RenderableType] = [t.table()]
    if sec.hidden:
        out.append(_more(sec.hidden, "island"))
    return out


def _devices(s: ClusterStatusView, sec: Section, width: int, _stuck: object, groups: list[DeviceGroup],
             *_: object) -> list[RenderableType]:
    shown_groups = groups[: sec.shown]
    hosts_shown = len({g.host for g in shown_groups})
    hosts_more = max(0, s.hosts_total - hosts_shown)
    rows_more = len(groups) - len(shown_groups)
    if sec.shown == 0:
        return [Text(f"devices: {s.devices_total:,} on {count(s.hosts_total, 'host')}", style="bold")]
    narrow = width < NARROW
    t = Grid(width, ("HOST", {"flex": True, "max": 24}), ("DEV", {"flex": True}), ("STATE", {}), ("UTIL", {}),
             ("RUNNING", {"flex": True}), ("JOB", {"max": 12}))
    for g in shown_groups:
        locals_ = ranges([d.local_index for d in g.devices])
        if not narrow:
            locals_ += f" (id {ranges([d.device_id for d in g.devices])})"
        if g.running:
            running = Text(g.running)
            if g.idle_s >= BUSY_WITHIN_S:
                running.append(f" ({seconds(g.idle_s)} ago)", style="dim")
        else:
            running = Text("idle", style="dim")
        state = Text(g.host_state, style="" if g.host_state == "ready" else "bold red")
        t.add_row(g.host, locals_, state, bar(g.utilization, 6 if narrow else 12), running, g.job or "-")
    out: list[RenderableType] = [t.table()]
    if rows_more or hosts_more:
        more = f"... and {count(hosts_more, 'more host')}" if hosts_more else f"... and {rows_more} more rows"
        out.append(Text(more + " (`pwctl device list`, `pwctl status -o json`)", style="dim"))
    return out


def _jobs(s: ClusterStatusView, sec: Section, width: int, *_: object) -> list[RenderableType]:
    if sec.shown == 0:
        return [Text(f"jobs: {s.jobs_running} running, {len(s.jobs) - s.jobs_running} recent", style="bold")]
    t = Grid(width, ("JOB", {}), ("NAME", {"flex": True, "max": 24}), ("STATE", {}), ("SUBMITTED", {}),
             ("EXIT", {}), ("REASON", {"flex": True}))
    for j in s.jobs[: sec.shown]:
        style = {"failed": "red", "running": "green", "pending": "yellow"}.get(j.state, "")
        t.add_row(j.id, j.name or "-", Text(j.state, style=style), age(j.submitted_at),
                  "-" if j.exit_code is None else str(j.exit_code), j.reason or "-")
    out: list[RenderableType] = [t.table()]
    if sec.hidden:
        out.append(_more(sec.hidden, "job", " (`pwctl jobs list`)"))
    return out


def _slices(s: ClusterStatusView, sec: Section, width: int, *_: object) -> list[RenderableType]:
    if sec.shown == 0:
        return [Text(f"slices: {len(s.slices)}", style="bold")]
    t = Grid(width, ("SLICE", {"flex": True, "max": 24}), ("STATE", {}), ("DEVICES", {"justify": "right"}),
             ("ISLAND", {"flex": True}), ("PROGRAMS", {"justify": "right"}), ("OWNER", {"flex": True}))
    for sl in s.slices[: sec.shown]:
        islands = ",".join(sorted({d.island for d in sl.devices})) or "-"
        t.add_row(sl.name, Text(sl.state, style="" if sl.state == "ready" else "yellow"), str(len(sl.devices)),
                  islands, str(sl.programs), sl.owner or "-")
    out: list[RenderableType] = [t.table()]
    if sec.hidden:
        out.append(_more(sec.hidden, "slice", " (`pwctl slice list`)"))
    return out


def _waits(s: ClusterStatusView, sec: Section, width: int, _stuck: object, _groups: object,
           groups: list[WaitGroup]) -> list[RenderableType]:
    waiting = sum(q.waiting for q in s.queues)
    if sec.shown == 0:
        return [Text(f"queues: {count(waiting, 'gang')} waiting", style="bold")]
    t = Grid(width, ("WAITING", {"justify": "right"}), ("ISLAND", {"flex": True}),
             ("PROGRAM", {"flex": True, "max": 24}), ("JOB", {}), ("RUNS", {"justify": "right"}),
             ("PRIORITY", {"justify": "right"}), ("WHY", {"flex": True}))
    rows = groups[: sec.shown]
    for g in rows:
        e = g.entry
        t.add_row(seconds(e.waiting_s), g.islands, e.program, e.job or "-", str(g.runs), str(e.priority),
                  e.reason or "-")
    out: list[RenderableType] = [t.table()]
    # the counts are per island queue (a gang over two islands waits in both); so are the rows'
    hidden = waiting - sum(g.runs * len(g.islands.split(",")) for g in rows)
    if hidden > 0:
        out.append(_more(hidden, "waiting gang", " (counted in each island queue it waits in)"))
    return out


_SECTIONS: dict[str, Callable[..., list[RenderableType]]] = {
    "stuck": _stuck, "islands": _islands, "devices": _devices, "jobs": _jobs, "slices": _slices,
    "waits": _waits}
