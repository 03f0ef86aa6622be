"""mlakv.Client: one channel to an mlakv server and the calls a prefill or
decode worker makes on it.

Results are the generated protobuf messages of proto/mlakv/v1/kv_cache.proto
(mlakv.pb.Sequence, mlakv.pb.Pool, ...), documented there; stored rows come
back as numpy arrays. Every failure raises mlakv.Error(code, message).
"""

import concurrent.futures
import dataclasses
import os
import threading
import time
import uuid
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from mlakv import regions as _regions
from mlakv import rows as _rows
from mlakv import save as _save
from mlakv._wire import _MESSAGE_OVERHEAD, _block_hashes, _scale, _set_first_fields, _set_part, _view
from mlakv.errors import Error, client_error
from mlakv.v1 import kv_cache_pb2 as pb
from mlakv.v1 import kv_cache_pb2_grpc as pb_grpc

# A lease to take with a call: the holder's name, or an mlakv.pb.LeaseOptions.
LeaseArg = Any

# Target size of one Append message (ckv + kpe bytes of all its layers).
DEFAULT_CHUNK_BYTES = 4 << 20
# Largest message this client accepts (ReadSequence chunks are ~4 MB plus framing).
_MAX_RECEIVE_BYTES = 64 << 20

_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@dataclasses.dataclass
class SequenceRows:
    """Rows of one sequence inside an append_batch.

    layers maps a layer index to its (ckv [N,512], kpe [N,64]) pair; every layer
    carries the same N rows, written at positions start .. start+N-1.
    start=None means the sequence's current length over these layers (0 for a
    new sequence); it costs one GetSequence per sequence, so a decode worker
    that tracks positions should pass them.
    """

    sequence: str
    layers: Mapping[int, Tuple[Any, Any]]
    start: Optional[int] = None
    # As Client.append: only this incarnation; block hashes of page-table
    # entries block_hashes_first_page + i.
    expect_generation: Optional[int] = None
    block_hashes: Any = ()
    block_hashes_first_page: int = 0


def _health_request(service):
    """grpc.health.v1.HealthCheckRequest{service} in wire format (field 1, string)."""
    data = service.encode()
    if len(data) >= 128:
        raise client_error("health service name too long")
    return (b"\x0a" + bytes([len(data)]) + data) if data else b""


def _health_status(data):
    """grpc.health.v1.HealthCheckResponse.status from wire format (field 1, varint)."""
    if len(data) >= 2 and data[0] == 0x08:
        return _HEALTH_STATUS.get(data[1], str(data[1]))
    return "UNKNOWN"


_CUDA_SYNC_MODES = ("stream", "event", "none")


def _lease_options(lease, duration_ms=0, what="lease"):
    """A pb.LeaseOptions from a holder name (str) or a pb.LeaseOptions; None stays None."""
    if lease is None:
        return None
    if isinstance(lease, pb.LeaseOptions):
        return lease
    if isinstance(lease, str):
        if duration_ms is None or int(duration_ms) < 0:
            raise client_error("%s duration_ms must be >= 0 (0: the pool's default), got %r" % (what, duration_ms))
        return pb.LeaseOptions(holder=lease, duration_ms=int(duration_ms))
    raise client_error("%s is a %s; give the holder's name (str) or an mlakv.pb.LeaseOptions"
                       % (what, type(lease).__name__))


@dataclasses.dataclass
class _LayerRows:
    """Prepared rows of one (ckv, kpe) pair: per layer, a contiguous numpy
    array [N, dim] sent as bytes, or a pb.RegionRef the server reads."""

    ckv: list
    kpe: list
    dtype: int
    rows: int
    cuda: list  # regions.CudaRegion entries the refs name (to fence before the call)

    def wire_row_bytes(self):
        """Bytes one row of every layer adds to a message (references add none)."""
        return sum(p.shape[1] * _rows.ELEMENT_BYTES for p in self.ckv + self.kpe if isinstance(p, np.ndarray))


def _extent(rows, row_stride_bytes, dim):
    """Bytes from the first row's start to the last row's end (a stride of 0: one row)."""
    row_bytes = dim * _rows.ELEMENT_BYTES
    return (rows - 1) * (row_stride_bytes or row_bytes) + row_bytes


class _CudaLayout:
    """A one-layer (ckv, kpe) pair of CUDA tensors that _prepare accepted, as
    Client._prepare_like compares a later pair with it."""

    __slots__ = ("types", "dtypes", "devices", "shapes", "strides", "regions", "extents", "row_strides", "dtype",
                 "rows")

    @staticmethod
    def of(ckv, kpe, prepared):
        """The layout of a pair _prepare turned into `prepared`, or None when
        it is not one layer of CUDA rows (nothing to repeat)."""
        if len(prepared.cuda) != 2 or len(prepared.ckv) != 1 or not isinstance(prepared.ckv[0], pb.RegionRef):
            return None
        layout = _CudaLayout()
        pair, refs = (ckv, kpe), (prepared.ckv[0], prepared.kpe[0])
        layout.types = tuple(type(x) for x in pair)
        layout.dtypes = tuple(x.dtype for x in pair)
        layout.devices = tuple(x.device for x in pair)
        layout.shapes = tuple(x.shape for x in pair)
        layout.strides = tuple(x.stride() for x in pair)
        layout.regions = tuple(prepared.cuda)
        layout.row_strides = tuple(r.row_stride_bytes for r in refs)
        layout.extents = tuple(_extent(prepared.rows, stride, dim)
                               for stride, dim in zip(layout.row_strides, (_rows.CKV_DIM, _rows.KPE_DIM)))
        layout.dtype, layout.rows = prepared.dtype, prepared.rows
        return layout


class Client:
    """A connection to an mlakv server.

    target: "host:port". token: sent as "authorization: Bearer <token>" on every
    call. timeout: deadline of every call in seconds (None: no deadline).
    credentials: grpc.ChannelCredentials for TLS (None: plaintext).
    chunk_bytes: target bytes per Append message (default 4 MB).
    options: extra gRPC channel arguments, e.g. [("grpc.keepalive_time_ms", 30000)].

    Regions (server --allow_ipc; see mlakv.regions and the README):
    cuda_sync: how appends of CUDA tensors make sure the producer's writes are
      done before the server reads them: "stream" (default) synchronizes the
      current torch stream of the tensors' device before the call; "event"
      registers each allocation with an interprocess CUDA event, records it on
      the current stream before the call and lets the server's stream wait on
      it (no host wait; appends naming one allocation are serialized); "none":
      the caller has synchronized.
    cuda_device_ids: the server's number for each local CUDA device index
      (a dict or a function); default: the same number (both processes see the
      GPUs in the same order, e.g. the same CUDA_VISIBLE_DEVICES).
    """

    def __init__(self, target: str, *, token: Optional[str] = None, timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 options: Iterable[Tuple[str, Any]] = (), cuda_sync: str = "stream",
                 cuda_device_ids: Any = None) -> None:
        options = [("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES)] + list(options)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = pb_grpc.KvCacheStub(self._channel)
        self._health = self._channel.unary_unary(_HEALTH_CHECK)  # raw bytes in and out
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        self.target = target
        self.timeout = timeout
        if chunk_bytes <= 0:
            raise client_error("chunk_bytes must be positive, got %r" % (chunk_bytes,))
        self.chunk_bytes = int(chunk_bytes)
        if cuda_sync not in _CUDA_SYNC_MODES:
            raise client_error("cuda_sync %r is not one of %s" % (cuda_sync, ", ".join(_CUDA_SYNC_MODES)))
        self.cuda_sync = cuda_sync
        self._cuda_device_ids = cuda_device_ids
        self._cuda_regions = []  # regions.CudaRegion this client registered
        self._cuda_lock = threading.Lock()
        self._shm_rows = []  # regions.ShmRows registered through this client
        self._layer_counts = {}  # pool name -> num_layers, looked up once for layer-wise saves
        self._no_commit_append = False  # the server answered CommitAppend UNIMPLEMENTED: saves end their streams
        self._opener = None  # one thread that starts saves' Append calls (_start_in_background), made on first use
        self._opener_pid = 0  # the process that made it (a forked child's copy has no thread behind it)
        self._opener_lock = threading.Lock()
        # Layer-wise saves made by this client: close() cancels those still
        # open (a save's stream thread waits for its layers until it ends).
        self._saves = weakref.WeakSet()
        self.closed = False

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Cancels the layer-wise saves still open (nothing of them is
        written; their wait() raises CANCELLED), unregisters the regions this
        client registered (CUDA allocations, ShmRows, best effort: the server
        may be gone) and closes the channel."""
        if self.closed:
            return
        for s in list(self._saves):
            s._close()
        for buf in list(self._shm_rows):
            try:
                buf.close()
            except Error:
                pass
        try:
            self.release_cuda_regions()
        except Error:
            pass
        self.closed = True
        with self._opener_lock:
            opener, self._opener = self._opener, None
        if opener is not None:
            opener.shutdown(wait=True)  # a call being started is started, and closed with the channel
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _start_in_background(self, start):
        """start() on the client's opener thread (one, kept for the client's
        life): a concurrent.futures.Future of its result, or None once the
        client is closing (the caller then starts inline)."""
        with self._opener_lock:
            if self.closed:
                return None
            if self._opener is None or self._opener_pid != os.getpid():
                self._opener = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                     thread_name_prefix="mlakv-save-open")
                self._opener_pid = os.getpid()
            return self._opener.submit(start)

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise Error.from_rpc_error(err) from None

    # -- health -----------------------------------------------------------

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 status of `service` ("" = the server): "SERVING", ...
        timeout: seconds for this call (None: the client's)."""
        return _health_status(self._call(self._health, _health_request(service), timeout))

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the server answers SERVING; raises Error(DEADLINE_EXCEEDED) otherwise.

        Calls wait for the connection (wait_for_ready), so a server that is
        still starting is retried at gRPC's reconnect backoff (1 s, 1.6 s, ...).
        """
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            try:
                status = _health_status(self._health(_health_request(""), timeout=max(0.1, min(left, 2.0)),
                                                     metadata=self._metadata, wait_for_ready=True))
                if status == "SERVING":
                    return
                last = "health status " + status
            except grpc.RpcError as err:
                last = "%s: %s" % (err.code().name, err.details())
            if time.monotonic() >= deadline:
                raise Error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "server at %s not SERVING after %.1f s (%s)" % (self.target, timeout, last))
            time.sleep(0.05)

    # -- pools ------------------------------------------------------------

    def pools(self, timeout: Optional[float] = None) -> List["pb.Pool"]:
        """Every pool (list of mlakv.pb.Pool), ordered by name. timeout: seconds
        for this call (None: the client's)."""
        return list(self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout).pools)

    def pool(self, name: str = "") -> "pb.Pool":
        """One pool (mlakv.pb.Pool); "" = the server's default pool."""
        return self._call(self._stub.GetPool, pb.GetPoolRequest(pool=name))

    def _layer_count(self, pool: str) -> int:
        """The pool's num_layers, from one GetPool per pool name for the
        client's life (a pool's layer count never changes)."""
        n = self._layer_counts.get(pool)
        if n is None:
            n = self._layer_counts[pool] = int(self.pool(pool).num_layers)
        return n

    # -- sequences --------------------------------------------------------

    def sequence(self, sequence: str, pool: str = "", *, expect_generation: Optional[int] = None,
                 lease: LeaseArg = None, lease_duration_ms: int = 0) -> "pb.Sequence":
        """A sequence's page table and lengths (mlakv.pb.Sequence): generation,
        leases, pinned and shared_pages included.

        expect_generation: answer only for this incarnation (else FAILED_PRECONDITION).
        lease: also take a lease on the sequence's current length, atomically
          with the page table returned (in .lease): the holder's name, with
          lease_duration_ms (0: the pool's default), or an mlakv.pb.LeaseOptions.
        """
        req = pb.GetSequenceRequest(pool=pool, sequence=sequence)
        if expect_generation is not None:
            req.expect_generation = expect_generation
        options = _lease_options(lease, lease_duration_ms)
        if options is not None:
            req.lease.CopyFrom(options)
        return self._call(self._stub.GetSequence, req)

    def get_sequence(self, sequence: str, pool: str = "", *, expect_generation: Optional[int] = None,
                     lease: LeaseArg = None, lease_duration_ms: int = 0) -> "pb.Sequence":
        """The same as sequence()."""
        return self.sequence(sequence, pool, expect_generation=expect_generation, lease=lease,
                             lease_duration_ms=lease_duration_ms)

    def sequences(self, pool: str = "", page_size: int = 0) -> List["pb.SequenceSummary"]:
        """Every sequence of a pool (list of mlakv.pb.SequenceSummary), following pagination."""
        out, token = [], ""
        while True:
            resp = self._call(self._stub.ListSequences,
                              pb.ListSequencesRequest(pool=pool, page_size=page_size, page_token=token))
            out.extend(resp.sequences)
            token = resp.next_page_token
            if not token:
                return out

    def page(self, page: int, pool: str = "") -> "pb.Page":
        """A page's owner and fill (mlakv.pb.Page)."""
        return self._call(self._stub.GetPage, pb.GetPageRequest(pool=pool, page=page))

    def free(self, sequence: str, pool: str = "", *, expect_generation: Optional[int] = None) -> int:
        """Releases a sequence and its pages; returns the number of pages freed
        now (pages a lease holds stay until it ends: see free_sequence)."""
        return self.free_sequence(sequence, pool, expect_generation=expect_generation).pages_freed

    def free_sequence(self, sequence: str, pool: str = "", *,
                      expect_generation: Optional[int] = None) -> "pb.FreeSequenceResponse":
        """Releases a sequence; returns mlakv.pb.FreeSequenceResponse (pages_freed,
        and the leases and pages_retained that keep the freed incarnation)."""
        req = pb.FreeSequenceRequest(pool=pool, sequence=sequence)
        if expect_generation is not None:
            req.expect_generation = expect_generation
        return self._call(self._stub.FreeSequence, req)

    def truncate(self, sequence: str, length: int, pool: str = "", *,
                 expect_generation: Optional[int] = None) -> "pb.Sequence":
        """Rolls a sequence back to `length` tokens in every layer; returns mlakv.pb.Sequence."""
        req = pb.TruncateSequenceRequest(pool=pool, sequence=sequence, length=length)
        if expect_generation is not None:
            req.expect_generation = expect_generation
        return self._call(self._stub.TruncateSequence, req)

    # -- leases, forks, prefix matches (docs/server.md "Leases", "Shared pages")

    def acquire_lease(self, sequence: str, holder: str, duration_ms: int = 0, tokens: int = 0, pool: str = "", *,
                      expect_generation: Optional[int] = None) -> "pb.Lease":
        """A lease on tokens [0, tokens) (0: the length) of every layer of a
        sequence: until it ends or expires they do not change and their pages
        stay, even through a free. Returns mlakv.pb.Lease (lease_id, expire_time_unix_ms, ...)."""
        req = pb.AcquireLeaseRequest(pool=pool, sequence=sequence, tokens=tokens,
                                     lease=_lease_options(holder, duration_ms))
        if expect_generation is not None:
            req.expect_generation = expect_generation
        return self._call(self._stub.AcquireLease, req)

    def renew_lease(self, lease_id: int, duration_ms: int = 0, pool: str = "") -> "pb.Lease":
        """Extends a lease to now + duration_ms (0: the pool's default); returns
        mlakv.pb.Lease. NOT_FOUND once it ended or expired."""
        return self._call(self._stub.RenewLease,
                          pb.RenewLeaseRequest(pool=pool, lease_id=lease_id, duration_ms=duration_ms))

    def release_lease(self, lease_id: int, pool: str = "") -> int:
        """Ends a lease; returns the pages it was the last holder of (now free)."""
        return self._call(self._stub.ReleaseLease, pb.ReleaseLeaseRequest(pool=pool, lease_id=lease_id)).pages_freed

    def list_leases(self, pool: str = "", page_size: int = 0) -> List["pb.Lease"]:
        """Every lease of a pool (list of mlakv.pb.Lease) by id, following pagination."""
        out, token = [], ""
        while True:
            resp = self._call(self._stub.ListLeases,
                              pb.ListLeasesRequest(pool=pool, page_size=page_size, page_token=token))
            out.extend(resp.leases)
            if resp.next_page_token and resp.next_page_token == token:
                raise Error(grpc.StatusCode.INTERNAL, "ListLeases returned the same page token twice")
            token = resp.next_page_token
            if not token:
                return out

    def fork_sequence(self, source: str, target: str, length: int = 0, pin: bool = False, pool: str = "", *,
                      expect_generation: Optional[int] = None) -> "pb.ForkSequenceResponse":
        """Creates `target` sharing the first `length` tokens (0: all) of
        `source`: full pages by reference, a partial last page copied.
        expect_generation pins the source's incarnation; pin creates the target
        pinned. Returns mlakv.pb.ForkSequenceResponse (sequence, pages_shared, pages_copied)."""
        if not source:
            raise client_error("fork_sequence: source is empty (fork_from_hashes forks from a hash chain)")
        req = pb.ForkSequenceRequest(pool=pool, source=source, target=target, length=length, pin=pin)
        if expect_generation is not None:
            req.expect_generation = expect_generation
        return self._call(self._stub.ForkSequence, req)

    def fork_from_hashes(self, block_hashes: Sequence[bytes], target: str, pin: bool = False,
                         pool: str = "") -> "pb.ForkSequenceResponse":
        """Creates `target` from the leading pages of a block-hash chain (list
        of bytes, first page first) the pool holds; no page is copied. When
        none matched nothing is created and the response has no sequence
        (resp.HasField("sequence") is False)."""
        hashes = _block_hashes(block_hashes)
        if not hashes:
            raise client_error("fork_from_hashes: no block hashes given")
        return self._call(self._stub.ForkSequence,
                          pb.ForkSequenceRequest(pool=pool, target=target, block_hashes=hashes, pin=pin))

    def match_prefix(self, block_hashes: Sequence[bytes], pool: str = "", *, lease: LeaseArg = None,
                     lease_duration_ms: int = 0) -> "pb.MatchPrefixResponse":
        """How many leading pages of a block-hash chain (list of bytes) the pool
        holds, and which: mlakv.pb.MatchPrefixResponse (matched_pages,
        matched_tokens, kv_indices). lease (a holder's name with
        lease_duration_ms, or an mlakv.pb.LeaseOptions) also takes a page lease
        on the matched pages (in .lease) so that they stay until a fork uses them."""
        req = pb.MatchPrefixRequest(pool=pool, block_hashes=_block_hashes(block_hashes))
        options = _lease_options(lease, lease_duration_ms)
        if options is not None:
            req.lease.CopyFrom(options)
        return self._call(self._stub.MatchPrefix, req)

    def _layer_lengths(self, sequence, pool):
        """The sequence's per-layer lengths; [] when it does not exist yet."""
        try:
            return list(self.sequence(sequence, pool).layer_lengths)
        except Error as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                return []
            raise

    @staticmethod
    def _start_from(lengths, layers):
        return min(lengths[l] if l < len(lengths) else 0 for l in layers)

    @staticmethod
    def _common_length(lengths, layers):
        """The length every layer given has, or None when they differ."""
        found = {lengths[l] if l < len(lengths) else 0 for l in layers}
        return found.pop() if len(found) == 1 else None

    # -- appends ----------------------------------------------------------

    def append(self, sequence: str, layer: Union[int, Sequence[int]], ckv: Any, kpe: Any, start: Optional[int] = None,
               pool: str = "", ckv_scale: Optional[float] = None, kpe_scale: Optional[float] = None,
               reserve_tokens: int = 0, dtype: Optional[str] = None, expect_length: Optional[int] = None,
               expect_generation: Optional[int] = None, block_hashes: Optional[Sequence[bytes]] = None,
               block_hashes_first_page: int = 0, pin: bool = False,
               view: Optional[str] = None) -> "pb.AppendResponse":
        """Appends rows of one sequence in one Append stream; returns mlakv.pb.AppendResponse.

        layer: a layer index with ckv [N,512] and kpe [N,64]; or a list of L
          layer indices with ckv [L,N,512] and kpe [L,N,64] (same positions).
        ckv, kpe: numpy float16, bfloat16 (uint16 bit patterns or ml_dtypes),
          or CPU torch float16/bfloat16 tensors, sent as bytes -- or, with a
          server started with --allow_ipc, by reference (the server reads them
          itself; nothing but offsets crosses the wire):
            * numpy views of a ShmRows of this client (any row stride);
            * CUDA torch float16/bfloat16 tensors (both ckv and kpe, on one
              device; rows with contiguous channels and any row stride). Each
              cudaMalloc allocation holding them is registered once (see
              cuda_sync, release_cuda_regions);
            * mlakv.RegionRows(region, offset, rows, row_stride_bytes) naming
              rows of a registered region (one per layer), with dtype= when
              neither tensor is data.
        start: position of the first row; None = the layer's current length
          (min over the layers given; 0 for a new sequence), read with one
          GetSequence before the stream starts; when the layers given all have
          that length it is also the expect_length: the append applies only if
          that length is still there, so that retrying after a lost response
          cannot write the rows twice.
        expect_length: apply only if every layer given holds exactly this many
          tokens (else FAILED_PRECONDITION and nothing is written).
        ckv_scale, kpe_scale: the global decode scales the rows were calibrated
          for (None: whatever the layer has; a layer without scales takes them).
        dtype: "bf16" / "f16", needed only when both tensors are RegionRows.
        expect_generation: apply only to this incarnation of the sequence (its
          Sequence.generation; else FAILED_PRECONDITION, or NOT_FOUND).
        block_hashes: block hashes (bytes, 1..64 each, chained by the caller) of
          page-table entries block_hashes_first_page + i, for match_prefix and
          fork_from_hashes; a page is indexed once it is complete in every layer.
        pin: when the append creates the sequence, it is never evicted nor
          freed by the idle TTL (free still frees it).
        view: what the response's sequence carries: None / "full" (the whole
          page table and per-layer lengths), "basic" (lengths, capacity, and
          in kv_indices only the pages this call allocated, from
          kv_indices_offset), "compact" ("basic" without pool, id, server_id),
          "lengths" ("compact" without the page table: kv_indices empty,
          kv_indices_offset the pages held).
        The rows travel as messages of about chunk_bytes each; the server
        applies the whole stream atomically. Rows passed by reference must not
        change until the call returns.
        """
        multi = isinstance(layer, (list, tuple))
        layers = [int(l) for l in layer] if multi else [int(layer)]
        if not layers:
            raise client_error("no layer given")
        view_code = _view(view)
        prepared = self._prepare(ckv, kpe, leading=(len(layers),) if multi else (), dtype=dtype)
        hashes = _block_hashes(block_hashes)
        n = prepared.rows
        if start is None:
            lengths = self._layer_lengths(sequence, pool)
            start = self._start_from(lengths, layers)
            if expect_length is None:
                expect_length = self._common_length(lengths, layers)
        # Rows per message so that a message, framing included, stays within
        # chunk_bytes; rows that all travel as references make one message.
        wire = prepared.wire_row_bytes()
        per_message = max(1, (self.chunk_bytes - _MESSAGE_OVERHEAD) // wire) if wire else max(n, 1)
        cs, ks = _scale(ckv_scale), _scale(kpe_scale)

        def messages():
            first = True
            for lo in range(0, max(n, 1), per_message):
                hi = min(n, lo + per_message)
                msg = pb.AppendRequest(pool=pool, sequence=sequence, start=start + lo, row_count=hi - lo,
                                       dtype=prepared.dtype)
                if first:
                    _set_first_fields(msg, reserve_tokens, expect_length, expect_generation, hashes,
                                      block_hashes_first_page, pin, view_code)
                for i, l in enumerate(layers):
                    rows = msg.layers.add(layer=l, ckv_scale=cs, kpe_scale=ks)
                    _set_part(rows, "ckv", prepared.ckv[i], lo, hi, _rows.CKV_DIM)
                    _set_part(rows, "kpe", prepared.kpe[i], lo, hi, _rows.KPE_DIM)
                first = False
                yield msg

        return self._call_fenced(prepared.cuda, self._stub.Append, messages())

    def save(self, sequence: str, start: int = 0, pool: str = "", *, dtype: Optional[str] = None,
             ckv_scale: Optional[float] = None, kpe_scale: Optional[float] = None,
             expect_length: Optional[int] = None, expect_generation: Optional[int] = None, reserve_tokens: int = 0,
             block_hashes: Optional[Sequence[bytes]] = None, block_hashes_first_page: int = 0, pin: bool = False,
             layerwise_min_tokens: int = _save.DEFAULT_LAYERWISE_MIN_TOKENS,
             layers_per_message: int = _save.DEFAULT_LAYERS_PER_MESSAGE,
             num_layers: Optional[int] = None, view: Optional[str] = None,
             commit_by_call: bool = False) -> "_save.LayerwiseSave":
        """A layer-wise save (mlakv.save.LayerwiseSave): `with c.save(seq) as s:
        s.layer(l, ckv, kpe)` for each layer, each call returning at once; leaving
        the block commits every layer atomically (one Append stream) or raises
        naming the layer. Arguments as for append; layerwise_min_tokens: below
        this many rows per layer everything is sent at the end in one go;
        layers_per_message: layers handed to the stream together (mlakv.save);
        num_layers: how many layers the save gives (default: the pool's, from
        one GetPool per pool for the client's life) -- once that many are given,
        the rest go at once instead of at wait(); view: what the response's
        sequence carries, as for append; commit_by_call: wait() commits by a
        CommitAppend call from its own thread instead of ending the stream
        (faster on hosts where gRPC Python's thread hand-overs are slow; even
        on a fast GPU host; docs/client.md)."""
        s = _save.LayerwiseSave(self, sequence, start=start, pool=pool, dtype=dtype, ckv_scale=ckv_scale,
                                kpe_scale=kpe_scale, expect_length=expect_length,
                                expect_generation=expect_generation, reserve_tokens=reserve_tokens,
                                block_hashes=block_hashes, block_hashes_first_page=block_hashes_first_page,
                                pin=pin, layerwise_min_tokens=layerwise_min_tokens,
                                layers_per_message=layers_per_message, num_layers=num_layers, view=view,
                                commit_by_call=commit_by_call)
        self._saves.add(s)
        return s

    def append_batch(self, items: Iterable[Any], pool: str = "", ckv_scale: Optional[float] = None,
                     kpe_scale: Optional[float] = None, dtype: Optional[str] = None,
                     view: Optional[str] = None) -> "pb.AppendBatchResponse":
        """A decode step: rows of many sequences and layers in one atomic AppendBatch.

        items: SequenceRows, or tuples (sequence, {layer: (ckv, kpe)}[, start]);
        ckv/kpe as for append (bytes, ShmRows views, CUDA tensors, RegionRows).
        All rows share one dtype (dtype= when only RegionRows give none). Returns mlakv.pb.AppendBatchResponse (the
        sequences after the append, in request order); view: what each of
        them carries, as for append. decode_step sends a step with one entry
        per layer for all sequences instead.
        """
        items = [it if isinstance(it, SequenceRows) else SequenceRows(*it) for it in items]
        req = pb.AppendBatchRequest(pool=pool, view=_view(view))
        batch_dtype = None
        used = []
        cs, ks = _scale(ckv_scale), _scale(kpe_scale)
        for it in items:
            if not it.layers:
                raise client_error("sequence %r: no layers given" % it.sequence)
            entry = req.sequences.add(sequence=it.sequence, block_hashes=_block_hashes(it.block_hashes),
                                      block_hashes_first_page=it.block_hashes_first_page)
            if it.expect_generation is not None:
                entry.expect_generation = it.expect_generation
            count = None
            for layer, (ckv, kpe) in sorted(it.layers.items()):
                what = "sequence %r layer %d " % (it.sequence, layer)
                prepared = self._prepare(ckv, kpe, what=what, dtype=dtype)
                dt, n = prepared.dtype, prepared.rows
                if batch_dtype is None:
                    batch_dtype = dt
                elif dt != batch_dtype:
                    raise client_error("%srows are %s but earlier rows are %s; one dtype per batch" % (
                        what, pb.RowDType.Name(dt), pb.RowDType.Name(batch_dtype)))
                if count is None:
                    count = n
                elif n != count:
                    raise client_error("%shas %d rows, other layers %d" % (what, n, count))
                rows = entry.layers.add(layer=layer, ckv_scale=cs, kpe_scale=ks)
                _set_part(rows, "ckv", prepared.ckv[0], 0, n, _rows.CKV_DIM)
                _set_part(rows, "kpe", prepared.kpe[0], 0, n, _rows.KPE_DIM)
                used.extend(prepared.cuda)
            entry.row_count = count
            if it.start is not None:
                entry.start = it.start
        req.dtype = batch_dtype if batch_dtype is not None else pb.ROW_DTYPE_UNSPECIFIED
        self._fill_starts(pool, [(entry, it.layers.keys()) for it, entry in zip(items, req.sequences)
                                 if it.start is None])
        return self._call_fenced(used, self._stub.AppendBatch, req)

    def decode_step(self, sequences: Sequence[str], ckv: Any, kpe: Any, *, layers: Optional[Sequence[int]] = None,
                    starts: Optional[Sequence[Optional[int]]] = None, row_counts: Optional[Sequence[int]] = None,
                    pool: str = "", ckv_scale: Optional[float] = None, kpe_scale: Optional[float] = None,
                    dtype: Optional[str] = None, view: Optional[str] = "compact") -> "pb.AppendBatchResponse":
        """A decode step in AppendBatch's compact form: per layer, one tensor
        holding the rows of every sequence, concatenated in `sequences` order.

        sequences: the step's sequence ids (each once; new ones are created).
        ckv [L, R, 512], kpe [L, R, 64]: layer i's rows of all sequences, R =
          sum(row_counts) (sequence 0's rows first); the same kinds as append
          takes -- CUDA tensors and ShmRows views go by reference, one region
          range per layer, and the server quantizes all layers in one launch;
          or a list of L RegionRows each, with dtype=.
        layers: the layer index of each of the L entries (default 0..L-1).
        starts: each sequence's position of its first row; None (or a None
          entry) = its current length over `layers`, read with one GetSequence
          each (concurrently), which then is also its expect_length.
        row_counts: rows of each sequence (default 1 each: a decode step).
        view: what each response entry carries (as append; default "compact":
          the sequences in request order without their names, and in
          kv_indices only the pages the step allocated; "packed": the same
          numbers as parallel arrays in response.packed -- lengths,
          kv_indices_offsets, new_page_counts, generations, new_pages -- and
          no response.sequences, the cheapest answer to a large step).
        Returns mlakv.pb.AppendBatchResponse; the whole step is atomic.
        """
        ids = [str(s) for s in sequences]
        if not ids:
            raise client_error("decode_step: no sequence given")
        counts = [1] * len(ids) if row_counts is None else [int(n) for n in row_counts]
        if len(counts) != len(ids) or any(n < 1 for n in counts):
            raise client_error("decode_step: row_counts must give a count >= 1 for each of the %d sequences, got %r"
                               % (len(ids), list(row_counts)[:8]))
        firsts = [None] * len(ids) if starts is None else list(starts)
        if len(firsts) != len(ids):
            raise client_error("decode_step: %d starts for %d sequences" % (len(firsts), len(ids)))
        view_code = _view(view)
        shape = getattr(ckv, "shape", None)
        if not isinstance(ckv, (list, tuple)) and (shape is None or len(shape) != 3):
            raise client_error("decode_step: ckv must be [layers, rows, 512] (or a list of RegionRows), got %s"
                               % (type(ckv).__name__ if shape is None else "shape %s" % (tuple(shape),)))
        n_layers = len(ckv) if isinstance(ckv, (list, tuple)) else int(shape[0])
        indices = list(range(n_layers)) if layers is None else [int(l) for l in layers]
        if len(indices) != n_layers:
            raise client_error("decode_step: %d layer indices for %d layers of rows" % (len(indices), n_layers))
        prepared = self._prepare(ckv, kpe, leading=(n_layers,), dtype=dtype)
        if prepared.rows != sum(counts):
            raise client_error("decode_step: each layer has %d rows but the sequences' row_counts sum to %d"
                               % (prepared.rows, sum(counts)))
        req = pb.AppendBatchRequest(pool=pool, dtype=prepared.dtype, view=view_code)
        for sid, n, first in zip(ids, counts, firsts):
            entry = req.sequences.add(sequence=sid, row_count=n)
            if first is not None:
                entry.start = int(first)
        cs, ks = _scale(ckv_scale), _scale(kpe_scale)
        for i, layer in enumerate(indices):
            rows = req.batch_layers.add(layer=layer, ckv_scale=cs, kpe_scale=ks)
            _set_part(rows, "ckv", prepared.ckv[i], 0, prepared.rows, _rows.CKV_DIM)
            _set_part(rows, "kpe", prepared.kpe[i], 0, prepared.rows, _rows.KPE_DIM)
        self._fill_starts(pool, [(entry, indices) for entry, first in zip(req.sequences, firsts) if first is None])
        return self._call_fenced(prepared.cuda, self._stub.AppendBatch, req)

    def _fill_starts(self, pool, entries):
        """Sets start (and expect_length, when the layers agree) of each
        (SequenceRows entry, layers) from the sequence's current lengths, asked
        concurrently; a sequence not found starts at 0."""
        futures = {s: self._stub.GetSequence.future(pb.GetSequenceRequest(pool=pool, sequence=s),
                                                     timeout=self.timeout, metadata=self._metadata)
                   for s in sorted({entry.sequence for entry, _ in entries})}
        for entry, layers in entries:
            try:
                lengths = list(futures[entry.sequence].result().layer_lengths)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise Error.from_rpc_error(err) from None
                lengths = []
            entry.start = self._start_from(lengths, layers)
            # Only if that end is still there: a retried step cannot append twice.
            common = self._common_length(lengths, layers)
            if common is not None:
                entry.expect_length = common

    # -- regions (server --allow_ipc) ------------------------------------------

    def register_shm(self, name: str, shm_name: str, offset: int = 0, size: int = 0) -> "pb.Region":
        """Registers a POSIX shared-memory object ("/name" as for shm_open) from
        `offset`, `size` bytes (0: to the end) as region `name`; returns mlakv.pb.Region."""
        return self._call(self._stub.RegisterShmRegion,
                          pb.RegisterShmRegionRequest(name=name, shm_name=shm_name, offset=offset, byte_size=size))

    def register_cuda(self, name: str, handle_bytes: bytes, device_id: int, byte_size: int,
                      event_handle: Optional[bytes] = None) -> "pb.Region":
        """Registers a CUDA allocation by its cudaIpcMemHandle_t (64 bytes), on
        `device_id` in the server's numbering, `byte_size` bytes from the
        handle's base; event_handle: optional cudaIpcEventHandle_t (64 bytes)
        the server waits for before each read. Returns mlakv.pb.Region.

        Client.append does this itself for CUDA torch tensors; this is for
        producers that manage their own allocations.
        """
        for what, value in (("handle_bytes", handle_bytes), ("event_handle", event_handle or b"")):
            if not isinstance(value, (bytes, bytearray)):
                raise client_error("%s is a %s; expected bytes" % (what, type(value).__name__))
        if len(handle_bytes) != 64 or (event_handle and len(event_handle) != 64):
            raise client_error("a CUDA IPC handle has 64 bytes; got handle_bytes of %d and event_handle of %d"
                               % (len(handle_bytes), len(event_handle or b"")))
        return self._call(self._stub.RegisterCudaRegion, pb.RegisterCudaRegionRequest(
            name=name, raw_handle=bytes(handle_bytes), device_id=device_id, byte_size=byte_size,
            raw_event_handle=bytes(event_handle or b"")))

    def unregister(self, name: str) -> int:
        """Forgets region `name`; returns the appends in flight that still hold it."""
        resp = self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(name=name))
        with self._cuda_lock:
            self._cuda_regions = [r for r in self._cuda_regions if r.name != name]
        return resp.appends_in_flight

    def regions(self) -> List["pb.Region"]:
        """The registered regions (list of mlakv.pb.Region), ordered by name."""
        return list(self._call(self._stub.ListRegions, pb.ListRegionsRequest()).regions)

    def export_pool(self, pool: str = "") -> "pb.ExportPoolResponse":
        """CUDA IPC handles and layout of a cuda pool's caches (mlakv.pb.ExportPoolResponse)."""
        return self._call(self._stub.ExportPool, pb.ExportPoolRequest(pool=pool))

    def shm_rows(self, rows: int, layers: int = 1, dtype: str = "bf16", name: Optional[str] = None) -> Any:
        """A new mlakv.ShmRows registered through this client (closed with it)."""
        return _regions.ShmRows(self, rows, layers=layers, dtype=dtype, name=name)

    def cuda_regions(self) -> List[str]:
        """Names of the CUDA allocations this client registered for tensors it appended."""
        with self._cuda_lock:
            return [r.name for r in self._cuda_regions]

    def release_cuda_regions(self) -> None:
        """Unregisters every CUDA allocation this client registered and drops the
        storages it kept alive in them. Call it before torch.cuda.empty_cache()
        should give that memory back; later appends register again."""
        with self._cuda_lock:
            regions, self._cuda_regions = self._cuda_regions, []
        first_error = None
        for r in regions:
            try:
                self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(name=r.name))
            except Error as err:
                if err.code != grpc.StatusCode.NOT_FOUND and first_error is None:
                    first_error = err
        if first_error is not None:
            raise first_error

    def _add_shm_rows(self, buf):
        self._shm_rows.append(buf)

    def _remove_shm_rows(self, buf):
        if buf in self._shm_rows:
            self._shm_rows.remove(buf)

    def _server_device(self, index):
        ids = self._cuda_device_ids
        if ids is None:
            return index
        try:
            return int(ids(index) if callable(ids) else ids[index])
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise client_error("cuda_device_ids has no server device for local cuda:%d (%s)" % (index, err)) from None

    def _cuda_region(self, tensor, address, extent):
        """The registered CudaRegion holding [address, address + extent) of
        `tensor`'s device; registers its allocation on first use."""
        device = tensor.device.index if tensor.device.index is not None else 0
        with self._cuda_lock:
            for r in self._cuda_regions:
                if r.device_index == device and r.contains(address, extent):
                    return r
            try:
                base, size, handle = _regions._Driver.get().allocation(device, address)
            except _regions.CudaDriverError as err:
                raise client_error("CUDA tensor on cuda:%d: %s" % (device, err)) from None
            if address + extent > base + size:
                raise client_error("CUDA rows at 0x%x (%d bytes) run past their allocation [0x%x, +%d)"
                                   % (address, extent, base, size))
            event, event_handle = None, None
            if self.cuda_sync == "event":
                import torch

                with torch.cuda.device(device):
                    event = torch.cuda.Event(interprocess=True)
                    event_handle = bytes(event.ipc_handle())
            name = "cuda-%d-%s-dev%d-%x" % (os.getpid(), uuid.uuid4().hex[:8], device, base)
            self.register_cuda(name, handle, self._server_device(device), size, event_handle)
            storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
            region = _regions.CudaRegion(name, device, base, size, storage, event)
            self._cuda_regions.append(region)
            return region

    def _cuda_refs(self, t, views, dim):
        """RegionRefs (one per layer) for the checked views of a CUDA tensor;
        registers the allocations not registered yet. Returns (refs, regions)."""
        refs, used = [], []
        for address, rows, stride in views:
            if rows == 0:  # nothing to read: an empty bytes part
                refs.append(np.zeros((0, dim), dtype=np.uint16))
                continue
            region = self._cuda_region(t, address, _extent(rows, stride, dim))
            refs.append(pb.RegionRef(region=region.name, offset=address - region.base, row_stride_bytes=stride))
            used.append(region)
        return refs, used

    def _prepare_layer(self, like, ckv, kpe, dtype=None):
        """_prepare of one layer's pair, by _prepare_like when `like` (the
        layout of the caller's previous pair, or None) fits. Returns
        (prepared, the layout to pass with the next pair)."""
        if like is not None:
            prepared = self._prepare_like(like, ckv, kpe)
            if prepared is not None:
                return prepared, like
        prepared = self._prepare(ckv, kpe, dtype=dtype)
        return prepared, (_CudaLayout.of(ckv, kpe, prepared) if prepared.cuda else None)

    def _prepare_like(self, like, ckv, kpe):
        """_prepare's result for a one-layer CUDA pair laid out as the pair
        `like` (a _CudaLayout) describes, else None (call _prepare).

        A layer-wise save hands over, layer after layer, views of the same
        buffers shifted by a stride: same tensor type, dtype, device, shape
        and strides, in allocations this client registered. For such a pair
        every check _prepare made for `like` holds again; only the addresses
        are new, and when each lies (with its rows) in the allocation the
        earlier pair's did, the refs are their offsets there -- about 15 us
        of host time less a layer than _prepare (docs/performance.md)."""
        refs, addresses = [None, None], (ckv, kpe)
        for k in (0, 1):
            x = addresses[k]
            if type(x) is not like.types[k] or x.dtype != like.dtypes[k] or x.shape != like.shapes[k] or \
                    x.stride() != like.strides[k] or x.device != like.devices[k]:
                return None
            region = like.regions[k]
            address = x.data_ptr()
            # Still registered (not unregistered or released since). Read
            # without _cuda_lock: removals replace the list, and a region
            # appended meanwhile is not the one looked for.
            if region not in self._cuda_regions or not region.contains(address, like.extents[k]):
                return None
            refs[k] = pb.RegionRef(region=region.name, offset=address - region.base,
                                   row_stride_bytes=like.row_strides[k])
        return _LayerRows([refs[0]], [refs[1]], like.dtype, like.rows, list(like.regions))

    def _prepare(self, ckv, kpe, leading=(), what="", dtype=None):
        """Validates a (ckv, kpe) pair of any accepted kind; returns _LayerRows.

        ckv/kpe: numpy or CPU torch rows (bytes, or references when they lie in
        a ShmRows of this client), CUDA torch tensors (references), or
        RegionRows (one per layer when leading is (L,)). Everything is checked
        before any CUDA allocation is registered."""
        layers = leading[0] if leading else 1
        names = (what + "ckv", what + "kpe")
        dims = (_rows.CKV_DIM, _rows.KPE_DIM)
        inputs = (ckv, kpe)
        cuda = [_regions.is_cuda_tensor(x) for x in inputs]
        explicit = [isinstance(x, _regions.RegionRows) or (isinstance(x, (list, tuple)) and len(x) > 0 and all(
            isinstance(r, _regions.RegionRows) for r in x)) for x in inputs]
        if any(cuda) and not all(cuda):
            raise client_error("%s is a CUDA tensor but %s is not; the server reads device rows only when both "
                               "come from CUDA memory" % (names[cuda.index(True)], names[cuda.index(False)]))
        if not any(cuda) and not any(explicit):
            a, b, dt, n = _rows.prepare(ckv, kpe, leading=leading, what=what, contiguous=False)
            if dtype is not None and _regions._dtype_code(dtype) != dt:
                raise client_error("%s and %s are %s but dtype=%r" % (names[0], names[1], pb.RowDType.Name(dt), dtype))
            arrays = (a, b) if leading else (a[None], b[None])
            parts = [self._host_parts(arr, dim, layers) for arr, dim in zip(arrays, dims)]
            return _LayerRows(parts[0], parts[1], dt, n, [])
        # 1. Check each tensor: its dtype (None for RegionRows), rows, and what to send.
        dtypes, counts, plans = [None, None], [None, None], [None, None]
        for k in (0, 1):
            x, name, dim = inputs[k], names[k], dims[k]
            if cuda[k]:
                dtypes[k] = _regions.torch_row_dtype(x, name)
                plans[k], counts[k] = _regions.cuda_layer_views(x, dim, name, leading)
            elif explicit[k]:
                refs = [x] if isinstance(x, _regions.RegionRows) else list(x)
                if len(refs) != layers or (not leading and not isinstance(x, _regions.RegionRows)):
                    raise client_error("%s: %d RegionRows for %d layer(s); give one per layer"
                                       % (name, len(refs), layers))
                rows = {r.rows for r in refs}
                if len(rows) != 1:
                    raise client_error("%s: the RegionRows have different row counts %s" % (name, sorted(rows)))
                counts[k] = rows.pop()
                plans[k] = [pb.RegionRef(region=r.region, offset=r.offset, row_stride_bytes=r.row_stride_bytes)
                            for r in refs]
            else:
                arr, dtypes[k] = _rows.to_numpy(x, name)
                arr = _rows._rows_2d(arr, dim, name, leading, contiguous=False)
                plans[k] = arr if leading else arr[None]
                counts[k] = plans[k].shape[-2]
        # 2. One dtype, one row count.
        known = {d for d in dtypes if d is not None}
        if dtype is not None:
            known.add(_regions._dtype_code(dtype))
        if len(known) > 1:
            raise client_error("%s and %s (and dtype=%r) disagree on the dtype: %s" % (
                names[0], names[1], dtype, ", ".join(sorted(pb.RowDType.Name(d) for d in known))))
        if not known:
            raise client_error("%s and %s come from RegionRows: pass dtype=\"bf16\" or \"f16\"" % names)
        if counts[0] != counts[1]:
            raise client_error("%s has %d rows but %s has %d" % (names[0], counts[0], names[1], counts[1]))
        # 3. What goes on the wire; CUDA allocations registered on first use.
        parts, used = [None, None], []
        for k in (0, 1):
            if cuda[k]:
                parts[k], regions = self._cuda_refs(inputs[k], plans[k], dims[k])
                used.extend(regions)
            elif explicit[k]:
                parts[k] = plans[k]
            else:
                parts[k] = self._host_parts(plans[k], dims[k], layers)
        return _LayerRows(parts[0], parts[1], known.pop(), counts[0], used)

    def _host_parts(self, arr, dim, layers):
        """Per layer of a numpy [L, N, dim]: a RegionRef when it lies in a ShmRows
        of this client, else a contiguous array (bytes)."""
        row_bytes = dim * _rows.ELEMENT_BYTES
        out = []
        for i in range(layers):
            ref = _regions.host_ref(arr[i], self._shm_rows, row_bytes) if self._shm_rows else None
            out.append(ref if ref is not None else np.ascontiguousarray(arr[i]))
        return out

    def _fence(self, regions, streams=None):
        """Makes the producer's writes to `regions` visible to the server before
        the call (cuda_sync); returns the locks to release after it. streams:
        {device index: torch stream} the writes were made on (default: each
        device's current stream)."""
        if not regions or self.cuda_sync == "none":
            return []
        import torch

        def stream(device):
            return streams[device] if streams else torch.cuda.current_stream(device)

        unique = sorted({r.name: r for r in regions}.values(), key=lambda r: r.name)
        if self.cuda_sync == "stream":
            for device in sorted({r.device_index for r in unique}):
                stream(device).synchronize()
            return []
        held = []
        try:
            for r in unique:
                r.lock.acquire()
                held.append(r.lock)
                s = stream(r.device_index)
                if r.recorded_on is not None and r.recorded_on != s:
                    s.wait_event(r.event)  # the record below then completes after the earlier stream's too
                r.event.record(s)
                r.recorded_on = s
        except BaseException:
            for lock in held:
                lock.release()
            raise
        return held

    @staticmethod
    def _producer_streams(regions):
        """{device index: current torch stream} of the devices `regions` are on."""
        import torch

        return {d: torch.cuda.current_stream(d) for d in {r.device_index for r in regions}}

    def _call_fenced(self, regions, method, request):
        held = self._fence(regions)
        try:
            return self._call(method, request)
        finally:
            for lock in held:
                lock.release()

    # -- reads ------------------------------------------------------------

    def _read(self, sequence, layer, start, count, pool, fmt, tokens_per_message, expect_generation=None,
              lease_id=0):
        req = pb.ReadSequenceRequest(pool=pool, sequence=sequence, layers=[layer], start=start, count=count,
                                     format=fmt, tokens_per_message=tokens_per_message, lease_id=lease_id)
        if expect_generation is not None:
            req.expect_generation = expect_generation
        chunks = []
        try:
            stream = self._stub.ReadSequence(req, timeout=self.timeout, metadata=self._metadata)
            expect = start
            for chunk in stream:
                if chunk.layer != layer or chunk.start != expect:
                    raise Error(grpc.StatusCode.INTERNAL,
                                "ReadSequence sent layer %d start %d; expected layer %d start %d"
                                % (chunk.layer, chunk.start, layer, expect))
                expect += chunk.count
                chunks.append(chunk)
        except grpc.RpcError as err:
            raise Error.from_rpc_error(err) from None
        return chunks

    @staticmethod
    def _join(chunks, field, dtype, width):
        data = b"".join(getattr(c, field) for c in chunks)
        return np.frombuffer(data, dtype=dtype).reshape(-1, width).copy()

    def export(self, sequence: str, layer: int, start: int = 0, count: int = 0, pool: str = "",
               tokens_per_message: int = 0, *, expect_generation: Optional[int] = None,
               lease_id: int = 0) -> Dict[str, Any]:
        """The stored bytes of one layer of a sequence, tokens [start, start+count)
        (count=0: up to the layer's length), as a dict:
          ckv_packed uint8 [T,256] (E2M1, low nibble = even channel),
          ckv_sf uint8 [T,32] (E4M3 block scales), kpe uint8 [T,64] (E4M3),
          ckv_scale, kpe_scale (float, the layer's global decode scales).
        expect_generation: only this incarnation. lease_id: read through a
          sequence lease (acquire_lease): the incarnation it holds, even after
          that was freed (sequence may then be "").
        """
        chunks = self._read(sequence, layer, start, count, pool, pb.READ_FORMAT_RAW, tokens_per_message,
                            expect_generation, lease_id)
        return {
            "ckv_packed": self._join(chunks, "ckv_packed", np.uint8, 256),
            "ckv_sf": self._join(chunks, "ckv_sf", np.uint8, 32),
            "kpe": self._join(chunks, "kpe", np.uint8, 64),
            "ckv_scale": chunks[0].ckv_scale if chunks else 0.0,
            "kpe_scale": chunks[0].kpe_scale if chunks else 0.0,
        }

    def read_dequantized(self, sequence: str, layer: int, start: int = 0, count: int = 0, pool: str = "",
                         tokens_per_message: int = 0, *, expect_generation: Optional[int] = None,
                         lease_id: int = 0) -> Dict[str, Any]:
        """The stored rows of one layer dequantized by the server: a dict with
        ckv float32 [T,512], kpe float32 [T,64], ckv_scale, kpe_scale
        (expect_generation, lease_id as for export)."""
        chunks = self._read(sequence, layer, start, count, pool, pb.READ_FORMAT_DEQUANTIZED, tokens_per_message,
                            expect_generation, lease_id)
        return {
            "ckv": self._join(chunks, "ckv_float", "<f4", _rows.CKV_DIM).astype(np.float32),
            "kpe": self._join(chunks, "kpe_float", "<f4", _rows.KPE_DIM).astype(np.float32),
            "ckv_scale": chunks[0].ckv_scale if chunks else 0.0,
            "kpe_scale": chunks[0].kpe_scale if chunks else 0.0,
        }
