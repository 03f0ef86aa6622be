"""Layer-wise saves: a prompt's KV sent layer by layer while the forward pass runs.

    with client.save("req-1", start=0) as s:        # one atomic Append stream
        for layer in range(61):
            ...                                     # the layer's attention writes ckv, kpe
            s.layer(layer, ckv, kpe)                # returns at once
    # leaving the block fenced once and committed every layer (or raised)

How each s.layer() returns at once:
  * host rows (numpy, CPU torch): checked, then queued; a gRPC thread turns
    them into messages of the stream while the caller goes on. The arrays
    must not change until the save ends (as vLLM's wait_for_save promises).
  * CUDA tensors (server --allow_ipc, a cuda pool): sent by reference. With
    the client's cuda_sync="event", each group of layers (below) records the
    allocations' interprocess events once, on the stream its layers were
    written on, when it is handed to the stream; the server waits for them
    before reading: no host wait on the caller's side. With cuda_sync="stream" each
    group synchronizes that stream first (a host wait per group). A group
    never spans two producer streams: a layer given on another stream than
    the layers waiting sends those first.

    One fence a group, not one a layer: a record on the producer's stream
    and the client's host work for it once per group (docs/performance.md
    "Layer-wise saves: the last layers at once, one fence a group, the
    server's work at the end"). The server quantizes rows by reference all
    layers in one launch, once it holds every layer of the pool and their
    events have completed (or at the stream's end), so its GPU work does not
    interleave with the forward pass either.

The save is one Append stream, so it is atomic: the server commits when the
save ends cleanly and rolls everything back otherwise. With
commit_by_call=True, wait() commits with a CommitAppend call made by its own thread, naming the stream (a commit_token
in its first message) and the messages sent, once the stream's thread has
sent them all: a blocking unary call is polled by the thread that makes it,
where the stream's end took a wake-up of gRPC's request thread, of its
channel's thread and of the caller (on the development VM wait() 100 ms
after the last layer took 1.24-1.43 ms this way against 2.37-2.58 ms; on
a fast GPU host the two are even, docs/performance.md -- hence not the
default). A server without
CommitAppend, or a commit call that fails, leaves the commit to the
stream's end, whose status is the truth either way. A layer the client
rejects (shape, dtype), a failed message, a body that raised, or a stream the
server ended: nothing of the save is written, and wait() (or leaving the
block) raises mlakv.Error naming the layer.

Layers go to the stream `layers_per_message` at a time (default 8; the rest
when the save ends): the stream's sending thread is Python and takes the GIL
for every message it builds and writes, time the caller's own thread (the
forward pass) then waits for -- measured on the H200 host, 61 one-layer
messages cost the caller ~5 ms of a 4k-token save, and the commit came
3.7 ms after the last layer against 1.4 ms in groups of 8. A group also
reaches the server as one message, quantized in one launch. 1 sends each
layer as soon as it is given.

The last layer goes at once: when the save has been given `num_layers`
layers (default: the pool's), the layers still waiting are handed to the
stream then, not at wait(). The server then holds every layer's reference
before the caller's last kernels have run and writes them all, in one
launch, as soon as those kernels are done -- into the save's reserved
pages, invisible until the commit -- so what is left at wait() is the end
of the stream: the commit and the response. The commit itself still waits
for wait() or the end of the block, so a body that raises after the last
layer still leaves nothing visible (the stream is rolled back).

Short prompts: below `layerwise_min_tokens` rows (default 256) per layer the
stream is not opened until the save ends and all layers go at once -- for
short prompts a stream per save costs more than it hides (the measurements
vLLM's and LMCache's layer-wise savers report).

vLLM's connector API maps one to one (docs/client.md "Layer-wise saves"):
  save_kv_layer(layer_name, kv_layer, attn_metadata)  -> s.layer(index, ckv, kpe)
  wait_for_save()                                     -> s.wait()
  get_finished(finished_req_ids)                      -> s.done() per request
"""

import queue
import re
import threading
import time
import uuid
from typing import Any, Optional

import grpc

from mlakv import rows as _rows
from mlakv._wire import _MESSAGE_OVERHEAD, _block_hashes, _scale, _set_first_fields, _set_part, _view
from mlakv.errors import Error, client_error
from mlakv.v1 import kv_cache_pb2 as pb

DEFAULT_LAYERWISE_MIN_TOKENS = 256
DEFAULT_LAYERS_PER_MESSAGE = 8
_END = object()
_MESSAGE_RE = re.compile(r"message (\d+)")


class LayerwiseSave:
    """One sequence's rows saved layer by layer (Client.save returns one)."""

    def __init__(self, client, sequence, *, start=0, pool="", dtype=None, ckv_scale=None, kpe_scale=None,
                 expect_length=None, expect_generation=None, reserve_tokens=0, block_hashes=None,
                 block_hashes_first_page=0, pin=False, layerwise_min_tokens=DEFAULT_LAYERWISE_MIN_TOKENS,
                 layers_per_message=DEFAULT_LAYERS_PER_MESSAGE, num_layers=None, view=None, commit_by_call=False):
        if not sequence:
            raise client_error("save: sequence id is empty")
        if int(layers_per_message) < 1:
            raise client_error("save: layers_per_message is %r; it must be at least 1" % (layers_per_message,))
        self._client = client
        self._sequence = sequence
        self._start = int(start)
        self._pool = pool
        self._dtype = dtype
        self._scales = (_scale(ckv_scale), _scale(kpe_scale))
        self._first_fields = dict(expect_length=expect_length, expect_generation=expect_generation,
                                  reserve_tokens=reserve_tokens, block_hashes=_block_hashes(block_hashes),
                                  block_hashes_first_page=block_hashes_first_page, pin=pin, view=_view(view))
        self._min_tokens = layerwise_min_tokens
        self._per_message = int(layers_per_message)
        if num_layers is not None and int(num_layers) < 1:
            raise client_error("save: num_layers is %r; it must be at least 1" % (num_layers,))
        self._num_layers = None if num_layers is None else int(num_layers)  # else the pool's, when the stream opens
        self._queue = queue.Queue()  # lists of (layer, prepared), then _END
        self._pending = []  # (layer, prepared) not queued yet: held back (short prompts) or a group filling up
        self._pending_streams = None  # {device: torch stream} the pending CUDA layers were written on
        self._future = None  # the Append call (a grpc future) once opened
        self._opening = None  # while the client's opener thread starts it: a concurrent.futures.Future of the call
        self._held = []  # CUDA region locks (cuda_sync="event"), released when the save ends
        # The CUDA tensors of the layers given: the server reads them when the
        # save ends (or once every layer's event completed), and a tensor the
        # caller dropped meanwhile (a layer's output, freed at the next layer)
        # would go back to torch's caching allocator, whose next block there
        # the server would read instead.
        self._keep = []
        self._end_sent = False  # the commit was asked for (CommitAppend, or the stream's end queued)
        self._sent_layers = []  # message index -> the layers it carries
        self._layers = set()
        self._rows = None
        self._row_dtype = None
        self._like = None  # the last CUDA pair's layout (Client._prepare_like), else None
        self._error = None  # the first failure found on the client side
        self._result = None
        self._finished = False
        self._lock = threading.Lock()
        # CommitAppend: the stream's name, and how far its thread has got --
        # groups handed to it and groups whose messages it has all sent.
        self._commit_by_call_on = bool(commit_by_call)
        self._token = uuid.uuid4().hex
        self._sent_all = threading.Condition(self._lock)
        self._groups_queued = 0
        self._groups_sent = 0
        self.committed_by_call = False  # wait() committed through CommitAppend (else the stream's end)
        # Experimental (cuda_save_test.py --wait poll): wait() polls the call
        # instead of sleeping on it, so that the answer is not also a thread's
        # wake-up. Not a public option until it is measured to help.
        self._poll_wait = False

    # -- the caller's side ------------------------------------------------

    def layer(self, layer: int, ckv: Any, kpe: Any, ckv_scale: Optional[float] = None,
              kpe_scale: Optional[float] = None) -> None:
        """Queues one layer's rows ckv [N,512], kpe [N,64] at positions start..start+N-1
        (ckv_scale, kpe_scale: this layer's, else the save's). Returns at once;
        failures are raised by wait()."""
        if self._finished:
            raise client_error("save of %r: layer %s after the save ended" % (self._sequence, layer))
        if self._error is not None:
            return
        try:
            self._add(int(layer), ckv, kpe, ckv_scale, kpe_scale)
        except Error as err:
            self._fail(Error(err.code, "save of %r, layer %s: %s" % (self._sequence, layer, err.message)))
        except BaseException:
            self._abort()
            raise

    def wait(self) -> "pb.AppendResponse":
        """Fences once and commits; returns mlakv.pb.AppendResponse. Raises
        mlakv.Error naming the layer when anything failed (nothing is written).
        Interrupted (KeyboardInterrupt) or failing on the client's side (a
        closed client), the save is cancelled and every later wait() raises
        the same mlakv.Error; whether it had committed is then certain only
        when the interruption came before the commit was asked for (the
        error's message says which)."""
        if self._finished:
            if self._error is not None:
                raise self._error
            return self._result
        self._finished = True
        try:
            return self._commit()
        except Error as err:
            if self._error is None:
                self._error = err
            self._cancel()
            raise
        except BaseException as exc:
            self._error = self._error or self._interrupted(exc)
            self._cancel()
            if isinstance(exc, Exception):  # every failure of a Client call raises mlakv.Error
                raise self._error from exc
            raise  # KeyboardInterrupt, SystemExit: as they came
        finally:
            self._release()

    def _commit(self):
        if self._error is not None:
            raise self._error
        if not self._layers:
            raise client_error("save of %r: no layer was given" % (self._sequence,))
        if not self._opened():
            self._open(background=False)  # wait() blocks anyway: no hop to another thread
        self._flush()  # a fence that fails leaves the commit unasked: wait() cancels the stream
        call = self._stream()  # a call that could not start (a closed channel) sent nothing
        self._end_sent = True
        committed = self._commit_by_call()
        self._queue.put(_END)  # the stream's end: after CommitAppend, only the half-close of a finished call
        if committed is not None:
            self._result = committed
            return self._result
        if self._poll_wait:
            while not call.done():
                time.sleep(0)  # lets gRPC's threads take the GIL
        try:
            self._result = call.result()
        except grpc.RpcError as err:
            self._error = self._named(Error.from_rpc_error(err))
            raise self._error from None
        return self._result

    def _interrupted(self, exc):
        """The save's error when wait() itself was interrupted or failed."""
        what = "%s%s" % (type(exc).__name__, ": %s" % exc if str(exc) else "")
        outcome = ("the stream was cancelled after its commit was asked for: it may have committed just before "
                   "(GetSequence shows the sequence's length)" if self._end_sent else
                   "the stream was cancelled before its commit was asked for: nothing was written")
        if isinstance(exc, Exception):
            return Error(grpc.StatusCode.UNKNOWN, "save of %r: wait() failed on the client's side (%s); %s"
                         % (self._sequence, what, outcome))
        return Error(grpc.StatusCode.CANCELLED, "save of %r: wait() was interrupted by %s; %s"
                     % (self._sequence, what, outcome))

    def done(self) -> bool:
        """True once the save has ended (committed or failed); never blocks."""
        if self._result is not None or (self._finished and self._error is not None):
            return True
        if self._opening is not None:
            if not self._opening.done():
                return False
            if self._opening.exception() is not None:
                return True  # the call never started; wait() raises why
        call = self._stream()
        return call is not None and call.done()

    def __enter__(self) -> "LayerwiseSave":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._abort()
            return False
        self.wait()
        return False

    # -- internals ----------------------------------------------------------

    def _add(self, layer, ckv, kpe, ckv_scale, kpe_scale):
        if not 0 <= layer < 2**32:
            raise client_error("layer %d is out of range: layers are numbered from 0" % layer)
        if layer in self._layers:
            raise client_error("layer %d given twice" % layer)
        prepared, self._like = self._client._prepare_layer(self._like, ckv, kpe, dtype=self._dtype)
        if self._rows is None:
            self._rows, self._row_dtype = prepared.rows, prepared.dtype
        elif prepared.rows != self._rows or prepared.dtype != self._row_dtype:
            raise client_error("%d %s rows; earlier layers have %d %s rows" % (
                prepared.rows, pb.RowDType.Name(prepared.dtype), self._rows, pb.RowDType.Name(self._row_dtype)))
        if ckv_scale is not None or kpe_scale is not None:  # this layer's, else the save's
            prepared.scales = (self._scales[0] if ckv_scale is None else _scale(ckv_scale),
                               self._scales[1] if kpe_scale is None else _scale(kpe_scale))
        if prepared.cuda:
            self._keep.append((ckv, kpe))
            streams = self._client._producer_streams(prepared.cuda)
            if self._pending and streams != self._pending_streams:
                self._flush()  # the waiting layers' fence goes on their own stream
            self._pending_streams = streams
        self._layers.add(layer)
        self._pending.append((layer, prepared))
        if not self._opened() and prepared.rows < self._min_tokens:
            return
        if not self._opened():
            self._check_client_open()
            if self._num_layers is None:
                self._num_layers = self._client._layer_count(self._pool)
            self._open(background=True)
        if len(self._pending) >= self._per_message or len(self._layers) >= self._num_layers:
            self._flush()

    def _flush(self):
        """Fences the layers given and not yet queued (their CUDA regions'
        events recorded once, on the stream they were written on) and hands
        them to the stream's thread."""
        if self._pending:
            regions = [r for _, prepared in self._pending for r in prepared.cuda]
            # Client._fence; the region locks it takes (reentrant) are held
            # until the save ends, while the server may still wait on them.
            self._held.extend(self._client._fence(regions, self._pending_streams))
            with self._lock:
                self._groups_queued += 1
            self._queue.put(self._pending)
            self._pending = []

    def _commit_by_call(self):
        """The commit as a blocking CommitAppend from this thread, once the
        stream's thread has sent every message: gRPC Python polls a blocking
        unary call on the calling thread, where the stream's end takes a wake-up
        of its request thread, of the channel's thread and of this one
        (docs/performance.md "What gRPC Python's end of a call costs"). None
        when it did not commit -- an old server (UNIMPLEMENTED), a stream that
        failed, any error: the stream's own answer then says what happened
        (its status is the truth either way; CommitAppend only ends it
        sooner)."""
        c = self._client
        if not self._commit_by_call_on or c._no_commit_append:
            return None
        with self._lock:
            # The messages of the groups queued are built on the stream's
            # thread; a group queued just now (the last layers, a connector's
            # wait_for_save right after its forward pass) is sent within
            # moments, while the server still waits for the GPU.
            while self._groups_sent < self._groups_queued and not self._future.done():
                self._sent_all.wait(0.05)
            messages = len(self._sent_layers) if self._groups_sent == self._groups_queued else 0
        if messages == 0 or self._future.done():
            return None
        try:
            resp = c._stub.CommitAppend(pb.CommitAppendRequest(commit_token=self._token, messages=messages),
                                        timeout=c.timeout, metadata=c._metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                c._no_commit_append = True  # a server from before CommitAppend: the stream's end commits
            return None
        self.committed_by_call = True
        return resp

    def _check_client_open(self):
        if self._client.closed:
            raise Error(grpc.StatusCode.FAILED_PRECONDITION, "client: the Client was closed; no call can start")

    def _opened(self):
        return self._future is not None or self._opening is not None

    def _open(self, background):
        """Starts the Append call. background: on the client's opener thread
        (Client._start_in_background), so that the caller's s.layer() returns
        at once -- gRPC Python starts a call with a stream of requests by
        starting a thread to read them (and its channel's polling thread when
        no other call is in flight), ~0.3 ms on the development VM and ~0.5 ms
        on an H100 host, which the first layer's call paid in the
        forward pass (docs/performance.md "A save's stream opened off the
        caller's thread"). The messages the caller queues meanwhile wait in
        the save's queue until the call's thread reads them."""
        c = self._client
        self._check_client_open()

        def start():
            return c._stub.Append.future(self._messages(), timeout=c.timeout, metadata=c._metadata)

        self._opening = c._start_in_background(start) if background else None
        if self._opening is None:  # inline, or the client is closing
            self._future = start()

    def _stream(self):
        """The Append call's future (None before it is opened), waiting for an
        open under way on the opener thread; what that open raised is raised
        here."""
        if self._future is None and self._opening is not None:
            opening, self._opening = self._opening, None
            self._future = opening.result()
        return self._future

    def _messages(self):
        """The stream's messages, built on gRPC's thread as layers arrive.

        Layers that are waiting together (the caller was faster than the
        stream, or a short prompt sent at the end) share one message when they
        fit in it -- always for rows by reference, which add no bytes -- so
        that the server quantizes them with one launch instead of one per
        layer. A layer too large for one message goes in several."""
        c = self._client
        budget = c.chunk_bytes - _MESSAGE_OVERHEAD
        first = [True]
        while True:
            item = self._queue.get()
            if item is _END:
                return
            batch, ended, groups = list(item), False, 1
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _END:
                    ended = True
                    break
                batch.extend(more)
                groups += 1
            group, group_bytes = [], 0
            for layer, prepared in batch:
                size = prepared.rows * prepared.wire_row_bytes()
                fits = (group and prepared.rows == group[0][1].rows and prepared.dtype == group[0][1].dtype
                        and group_bytes + size <= budget)
                if group and not fits:
                    yield from self._build(group, budget, first)
                    group, group_bytes = [], 0
                group.append((layer, prepared))
                group_bytes += size
            if group:
                yield from self._build(group, budget, first)
            # Every message of these groups is sent (gRPC asks for the next
            # message once the last one's send has completed).
            with self._lock:
                self._groups_sent += groups
                self._sent_all.notify_all()
            if ended:
                return

    def _build(self, group, budget, first):
        """Messages for `group`: layers of one row count and dtype, in one
        message when they fit, else one layer's rows over several messages."""
        n, dtype = group[0][1].rows, group[0][1].dtype
        wire = sum(p.wire_row_bytes() for _, p in group)
        per_message = max(1, budget // wire) if wire else max(n, 1)
        for lo in range(0, max(n, 1), per_message):
            hi = min(n, lo + per_message)
            msg = pb.AppendRequest(pool=self._pool, sequence=self._sequence, start=self._start + lo,
                                   row_count=hi - lo, dtype=dtype)
            if first[0]:
                _set_first_fields(msg, **self._first_fields)
                msg.commit_token = self._token
                first[0] = False
            for layer, prepared in group:
                cs, ks = getattr(prepared, "scales", None) or self._scales
                rows = msg.layers.add(layer=layer, ckv_scale=cs, kpe_scale=ks)
                _set_part(rows, "ckv", prepared.ckv[0], lo, hi, _rows.CKV_DIM)
                _set_part(rows, "kpe", prepared.kpe[0], lo, hi, _rows.KPE_DIM)
            with self._lock:
                self._sent_layers.append([layer for layer, _ in group])
            yield msg

    def _named(self, err):
        """The server's status, prefixed with the save and, when it names a
        message of the stream, that message's layer."""
        where = ""
        m = _MESSAGE_RE.search(err.message)
        if m:
            index = int(m.group(1)) - 1  # the server counts messages from 1
            with self._lock:
                if 0 <= index < len(self._sent_layers):
                    layers = self._sent_layers[index]
                    where = (", layer %d" % layers[0] if len(layers) == 1 else
                             ", layers %s" % ", ".join(str(x) for x in layers))
        return Error(err.code, "save of %r%s: %s" % (self._sequence, where, err.message))

    def _fail(self, err):
        """A client-side failure: remembered for wait(), the stream cancelled
        so that nothing of it commits."""
        if self._error is None:
            self._error = err
        self._cancel()

    def _cancel(self):
        opening = self._opening
        if opening is not None and opening.cancel():  # its start had not begun: no call, nothing sent
            self._opening = None
            return
        try:
            call = self._stream()
        except Exception:  # the call never started: nothing to cancel
            call = None
        if call is not None:
            call.cancel()
            self._queue.put(_END)

    def _abort(self):
        """The caller's block raised: cancel, release, never commit. A save
        that has committed already (wait() inside the block) stays committed."""
        if self._result is not None:
            return
        self._finished = True
        if self._error is None:
            self._error = Error(grpc.StatusCode.CANCELLED, "save of %r: cancelled by the caller's exception"
                                % (self._sequence,))
        self._cancel()
        self._release()

    def _release(self):
        held, self._held = self._held, []
        for lock in held:
            lock.release()
        self._keep = []

    def _close(self):
        """Client.close() with the save still open: cancelled, never committed."""
        if self._finished:
            return
        self._error = Error(grpc.StatusCode.CANCELLED, "save of %r: the client was closed before the save ended; "
                            "nothing was written" % (self._sequence,))
        self._abort()
