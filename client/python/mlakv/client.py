"""mlakv.Client: one channel to an mlakv server and the calls a prefill or
decode worker makes on it.

Results are the generated protobuf messages of proto/mlakv/v1/kv_cache.proto
(mlakv.pb.Sequence, mlakv.pb.Pool, ...), documented there; stored rows come
back as numpy arrays. Every failure raises mlakv.Error(code, message).
"""

import dataclasses
import time
from typing import Any, Mapping, Optional, Tuple

import grpc
import numpy as np

from mlakv import rows as _rows
from mlakv.errors import Error, client_error
from mlakv.v1 import kv_cache_pb2 as pb
from mlakv.v1 import kv_cache_pb2_grpc as pb_grpc

# Target size of one Append message (ckv + kpe bytes of all its layers).
DEFAULT_CHUNK_BYTES = 4 << 20
# Bytes of an AppendRequest besides the rows (ids, counts, per-layer tags), bounded.
_MESSAGE_OVERHEAD = 1024
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


def _scale(value):
    return 0.0 if value is None else float(value)


class Client:
    """A connection to an mlakv server.

    target: "host:port". token: sent as "authorization: Bearer <token>" on every
    call. timeout: deadline of every call in seconds (None: no deadline).
    credentials: grpc.ChannelCredentials for TLS (None: plaintext).
    chunk_bytes: target bytes per Append message (default 4 MB).
    options: extra gRPC channel arguments, e.g. [("grpc.keepalive_time_ms", 30000)].
    """

    def __init__(self, target, *, token=None, timeout=None, credentials=None,
                 chunk_bytes=DEFAULT_CHUNK_BYTES, options=()):
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

    # -- lifetime ---------------------------------------------------------

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise Error.from_rpc_error(err) from None

    # -- health -----------------------------------------------------------

    def health(self, service=""):
        """grpc.health.v1 status of `service` ("" = the server): "SERVING", ..."""
        return _health_status(self._call(self._health, _health_request(service)))

    def wait_ready(self, timeout=30.0):
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

    def pools(self):
        """Every pool (list of mlakv.pb.Pool), ordered by name."""
        return list(self._call(self._stub.ListPools, pb.ListPoolsRequest()).pools)

    def pool(self, name=""):
        """One pool (mlakv.pb.Pool); "" = the server's default pool."""
        return self._call(self._stub.GetPool, pb.GetPoolRequest(pool=name))

    # -- sequences --------------------------------------------------------

    def sequence(self, sequence, pool=""):
        """A sequence's page table and lengths (mlakv.pb.Sequence)."""
        return self._call(self._stub.GetSequence, pb.GetSequenceRequest(pool=pool, sequence=sequence))

    def sequences(self, pool="", page_size=0):
        """Every sequence of a pool (list of mlakv.pb.SequenceSummary), following pagination."""
        out, token = [], ""
        while True:
            resp = self._call(self._stub.ListSequences,
                              pb.ListSequencesRequest(pool=pool, page_size=page_size, page_token=token))
            out.extend(resp.sequences)
            token = resp.next_page_token
            if not token:
                return out

    def page(self, page, pool=""):
        """A page's owner and fill (mlakv.pb.Page)."""
        return self._call(self._stub.GetPage, pb.GetPageRequest(pool=pool, page=page))

    def free(self, sequence, pool=""):
        """Releases a sequence and its pages; returns the number of pages freed."""
        return self._call(self._stub.FreeSequence,
                          pb.FreeSequenceRequest(pool=pool, sequence=sequence)).pages_freed

    def truncate(self, sequence, length, pool=""):
        """Rolls a sequence back to `length` tokens in every layer; returns mlakv.pb.Sequence."""
        return self._call(self._stub.TruncateSequence,
                          pb.TruncateSequenceRequest(pool=pool, sequence=sequence, length=length))

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

    # -- appends ----------------------------------------------------------

    def append(self, sequence, layer, ckv, kpe, start=None, pool="", ckv_scale=None, kpe_scale=None,
               reserve_tokens=0):
        """Appends rows of one sequence in one Append stream; returns mlakv.pb.AppendResponse.

        layer: a layer index with ckv [N,512] and kpe [N,64]; or a list of L
          layer indices with ckv [L,N,512] and kpe [L,N,64] (same positions).
        ckv, kpe: numpy float16, bfloat16 (uint16 bit patterns or ml_dtypes),
          or CPU torch float16/bfloat16 tensors.
        start: position of the first row; None = the layer's current length
          (min over the layers given; 0 for a new sequence), read with one
          GetSequence before the stream starts.
        ckv_scale, kpe_scale: the global decode scales the rows were calibrated
          for (None: whatever the layer has; a layer without scales takes them).
        The rows travel as messages of about chunk_bytes each; the server
        applies the whole stream atomically.
        """
        multi = isinstance(layer, (list, tuple))
        layers = [int(l) for l in layer] if multi else [int(layer)]
        if not layers:
            raise client_error("no layer given")
        ckv, kpe, dtype, n = _rows.prepare(ckv, kpe, leading=(len(layers),) if multi else ())
        if not multi:
            ckv, kpe = ckv[None], kpe[None]
        if start is None:
            start = self._start_from(self._layer_lengths(sequence, pool), layers)
        # Rows per message so that a message, framing included, stays within chunk_bytes.
        per_message = max(1, (self.chunk_bytes - _MESSAGE_OVERHEAD) // (_rows.row_bytes() * len(layers)))
        cs, ks = _scale(ckv_scale), _scale(kpe_scale)

        def messages():
            first = True
            for lo in range(0, max(n, 1), per_message):
                hi = min(n, lo + per_message)
                msg = pb.AppendRequest(pool=pool, sequence=sequence, start=start + lo, row_count=hi - lo,
                                       dtype=dtype, reserve_tokens=reserve_tokens if first else 0)
                for i, l in enumerate(layers):
                    msg.layers.add(layer=l, ckv=ckv[i, lo:hi].tobytes(), kpe=kpe[i, lo:hi].tobytes(),
                                   ckv_scale=cs, kpe_scale=ks)
                first = False
                yield msg

        return self._call(self._stub.Append, messages())

    def append_batch(self, items, pool="", ckv_scale=None, kpe_scale=None):
        """A decode step: rows of many sequences and layers in one atomic AppendBatch.

        items: SequenceRows, or tuples (sequence, {layer: (ckv, kpe)}[, start]).
        All rows share one dtype. Returns mlakv.pb.AppendBatchResponse (the
        sequences after the append, in request order).
        """
        items = [it if isinstance(it, SequenceRows) else SequenceRows(*it) for it in items]
        req = pb.AppendBatchRequest(pool=pool)
        dtype = None
        cs, ks = _scale(ckv_scale), _scale(kpe_scale)
        for it in items:
            if not it.layers:
                raise client_error("sequence %r: no layers given" % it.sequence)
            entry = req.sequences.add(sequence=it.sequence)
            count = None
            for layer, (ckv, kpe) in sorted(it.layers.items()):
                what = "sequence %r layer %d " % (it.sequence, layer)
                ckv, kpe, dt, n = _rows.prepare(ckv, kpe, what=what)
                if dtype is None:
                    dtype = dt
                elif dt != dtype:
                    raise client_error("%srows are %s but earlier rows are %s; one dtype per batch" % (
                        what, pb.RowDType.Name(dt), pb.RowDType.Name(dtype)))
                if count is None:
                    count = n
                elif n != count:
                    raise client_error("%shas %d rows, other layers %d" % (what, n, count))
                entry.layers.add(layer=layer, ckv=ckv.tobytes(), kpe=kpe.tobytes(), ckv_scale=cs, kpe_scale=ks)
            entry.row_count = count
            if it.start is not None:
                entry.start = it.start
        req.dtype = dtype if dtype is not None else pb.ROW_DTYPE_UNSPECIFIED
        # Starts left to the server's state: every sequence's lengths, asked concurrently.
        missing = {it.sequence for it in items if it.start is None}
        futures = {s: self._stub.GetSequence.future(pb.GetSequenceRequest(pool=pool, sequence=s),
                                                     timeout=self.timeout, metadata=self._metadata)
                   for s in sorted(missing)}
        for it, entry in zip(items, req.sequences):
            if it.start is None:
                try:
                    lengths = list(futures[it.sequence].result().layer_lengths)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        raise Error.from_rpc_error(err) from None
                    lengths = []
                entry.start = self._start_from(lengths, it.layers.keys())
        return self._call(self._stub.AppendBatch, req)

    # -- reads ------------------------------------------------------------

    def _read(self, sequence, layer, start, count, pool, fmt, tokens_per_message):
        req = pb.ReadSequenceRequest(pool=pool, sequence=sequence, layers=[layer], start=start, count=count,
                                     format=fmt, tokens_per_message=tokens_per_message)
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

    def export(self, sequence, layer, start=0, count=0, pool="", tokens_per_message=0):
        """The stored bytes of one layer of a sequence, tokens [start, start+count)
        (count=0: up to the layer's length), as a dict:
          ckv_packed uint8 [T,256] (E2M1, low nibble = even channel),
          ckv_sf uint8 [T,32] (E4M3 block scales), kpe uint8 [T,64] (E4M3),
          ckv_scale, kpe_scale (float, the layer's global decode scales).
        """
        chunks = self._read(sequence, layer, start, count, pool, pb.READ_FORMAT_RAW, tokens_per_message)
        return {
            "ckv_packed": self._join(chunks, "ckv_packed", np.uint8, 256),
            "ckv_sf": self._join(chunks, "ckv_sf", np.uint8, 32),
            "kpe": self._join(chunks, "kpe", np.uint8, 64),
            "ckv_scale": chunks[0].ckv_scale if chunks else 0.0,
            "kpe_scale": chunks[0].kpe_scale if chunks else 0.0,
        }

    def read_dequantized(self, sequence, layer, start=0, count=0, pool="", tokens_per_message=0):
        """The stored rows of one layer dequantized by the server: a dict with
        ckv float32 [T,512], kpe float32 [T,64], ckv_scale, kpe_scale."""
        chunks = self._read(sequence, layer, start, count, pool, pb.READ_FORMAT_DEQUANTIZED, tokens_per_message)
        return {
            "ckv": self._join(chunks, "ckv_float", "<f4", _rows.CKV_DIM).astype(np.float32),
            "kpe": self._join(chunks, "kpe_float", "<f4", _rows.KPE_DIM).astype(np.float32),
            "ckv_scale": chunks[0].ckv_scale if chunks else 0.0,
            "kpe_scale": chunks[0].kpe_scale if chunks else 0.0,
        }
