"""How the IFRT proxy's bulk transfers went: each upload or download of 4 MiB or more between the
controller and a worker (server/proxy/bulk.py's `BULK_MIN_BYTES`), by direction and path:
`tcp`, on the worker's TCP transfer port, or `grpc`, the fallback (no connection could be made)
and the only path on a cluster with TLS or a controller started with --no-bulk-links. Kept by
the proxy's sessions as they go, read by the metrics' collector at scrape time
(server/controller/metrics.py, `pathways_proxy_bulk_transfers_total`). No imports: the
controller builds it before the proxy's modules load (they load with the first proxy call)."""

from __future__ import annotations

DIRECTIONS = ("upload", "download")
PATHS = ("tcp", "grpc")


class TransferCounts:
    """Transfers and their bytes by (direction, path); counters, never reset."""

    def __init__(self) -> None:
        self.transfers = dict.fromkeys(((d, p) for d in DIRECTIONS for p in PATHS), 0)
        self.bytes = dict(self.transfers)

    def started(self, direction: str, path: str, nbytes: int = 0) -> None:
        """A transfer started on `path`, of `nbytes` (known up front: an upload's)."""
        self.transfers[(direction, path)] += 1
        self.bytes[(direction, path)] += nbytes

    def moved(self, direction: str, path: str, nbytes: int) -> None:
        """More bytes of a transfer whose size was not known when it started (a download's)."""
        self.bytes[(direction, path)] += nbytes
