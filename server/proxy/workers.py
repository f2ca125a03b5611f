"""A proxy session's channels to the workers of its slice: one per worker, with the stub and the
raw methods that move array bytes without decoding them (uploads serialized by `wire`, fetched
answers left serialized: fetching.py)."""

from __future__ import annotations

from typing import Any

from grpc import aio

from pwctl import tls as tls_
from pwctl.transport import KEEPALIVE_OPTIONS
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

from .. import bulklink
from . import fetching
from .bulk import BulkLinks
from .transfer_counts import TransferCounts

# keepalive: a call to a worker whose host vanished (no FIN, no RST) fails within its 20 s timeout
# instead of the kernel's ~15 minutes of retransmissions (docs/facts.md, "Peers that vanish")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20),
                   *KEEPALIVE_OPTIONS]
PUT_METHOD = "/pathways.v1.Worker/PutBuffers"


class WorkerChannels:
    """Channels to workers by address, opened on first use and kept until `close`; over TLS with
    `tls` (the controller's own certificate is its client certificate). With the session's
    `credential` (and `metadata`, the calls' token), `bulk`: its TCP connections for bulk bytes
    (bulk.py), on a cluster without TLS unless `bulk_links` is off (the controller's
    --no-bulk-links). `counts`: where the session's bulk transfers are counted, by path."""

    def __init__(self, tls: tls_.TlsConfig | None = None, credential: str = "", token: str = "",
                 metadata: tuple[tuple[str, str], ...] = (), bulk_links: bool = True,
                 counts: TransferCounts | None = None) -> None:
        self._tls = tls
        self._metadata = metadata
        self.counts = counts
        self.bulk: BulkLinks | None = None
        if credential and tls is None and bulk_links:
            self.bulk = BulkLinks(bulklink.hello_secret(token, credential), self._data_address)
        self._channels: dict[str, tuple[aio.Channel, wgrpc.WorkerStub]] = {}
        self._fetchers: dict[str, Any] = {}  # address -> its Fetch with undecoded answers
        self._putters: dict[str, Any] = {}  # address -> its PutBuffers taking serialized requests

    def stub(self, address: str) -> wgrpc.WorkerStub:
        conn = self._channels.get(address)
        if conn is None:
            channel = tls_.aio_channel(address, CHANNEL_OPTIONS, self._tls)
            conn = self._channels[address] = (channel, wgrpc.WorkerStub(channel))
        return conn[1]

    def put_raw(self, address: str) -> Any:
        """The worker's `PutBuffers`, taking requests already serialized (`wire.put_buffer_request`)."""
        call = self._putters.get(address)
        if call is None:
            self.stub(address)
            call = self._putters[address] = self._channels[address][0].stream_unary(
                PUT_METHOD, request_serializer=None, response_deserializer=wpb.PutBuffersResponse.FromString)
        return call

    def fetch_raw(self, address: str) -> Any:
        """The worker's `Fetch` with its answers left serialized (fetching.py)."""
        call = self._fetchers.get(address)
        if call is None:
            self.stub(address)
            call = self._fetchers[address] = fetching.fetch_method(self._channels[address][0])
        return call

    async def _data_address(self, address: str) -> str:
        """The worker's transfer port, which its `Stats` names."""
        stats = await self.stub(address).Stats(wpb.WorkerStatsRequest(), metadata=self._metadata, timeout=10)
        return str(stats.data_address)

    async def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()
        channels = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        self._fetchers.clear()
        self._putters.clear()
        for channel in channels:
            await channel.close()
