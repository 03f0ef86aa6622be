"""Regions (server --allow_ipc): rows the server reads from this process's memory.

Instead of sending rows as bytes, a producer on the server's host registers
memory with the server once and names it in each append (a RegionRef: region,
byte offset of the first row, row stride). Two kinds (docs/server.md "Regions"):

  * host shared memory: ShmRows creates a POSIX shared-memory object, registers
    it, and hands out numpy views; rows written into them are appended by
    reference (Client.append recognizes the views);
  * CUDA memory: Client.append accepts CUDA torch tensors; the client registers
    each cudaMalloc allocation that holds them once (cuIpcGetMemHandle) and
    sends the tensors' offsets and row strides.

RegionRows names rows in a region explicitly (any layout the producer chose).
"""

import ctypes
import dataclasses
import mmap
import os
import threading
import uuid
from multiprocessing import shared_memory

import numpy as np

from mlakv import rows as _rows
from mlakv.errors import client_error
from mlakv.v1 import kv_cache_pb2 as pb


@dataclasses.dataclass(frozen=True)
class RegionRows:
    """`rows` rows of one tensor in a registered region: row i starts at byte
    offset + i * row_stride_bytes of the region (0: packed rows, 1024 bytes
    for bf16/f16 ckv, 128 for kpe); each row's elements are contiguous.

    Pass as ckv= / kpe= to Client.append or inside append_batch items (with
    dtype= when neither tensor of a layer is data); for a multi-layer append,
    a list with one RegionRows per layer.
    """

    region: str
    offset: int
    rows: int
    row_stride_bytes: int = 0

    def __post_init__(self):
        if not isinstance(self.region, str) or not self.region:
            raise client_error("RegionRows.region must be a non-empty region name, got %r" % (self.region,))
        for field in ("offset", "rows", "row_stride_bytes"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise client_error("RegionRows.%s must be a non-negative integer, got %r" % (field, value))


def _dtype_code(dtype):
    """"bf16" / "f16" / a RowDType value -> RowDType."""
    names = {"bf16": pb.ROW_DTYPE_BFLOAT16, "bfloat16": pb.ROW_DTYPE_BFLOAT16,
             "f16": pb.ROW_DTYPE_FLOAT16, "float16": pb.ROW_DTYPE_FLOAT16}
    if isinstance(dtype, str) and dtype.lower() in names:
        return names[dtype.lower()]
    if dtype in (pb.ROW_DTYPE_BFLOAT16, pb.ROW_DTYPE_FLOAT16):
        return dtype
    raise client_error("dtype %r is not \"bf16\" or \"f16\"" % (dtype,))


# -- host shared memory ----------------------------------------------------


class ShmRows:
    """Rows in a POSIX shared-memory object registered with the server.

        with mlakv.ShmRows(client, rows=4096, layers=61, dtype="bf16") as buf:
            buf.ckv[l, :n] = ...     # numpy [layers, rows, 512]: uint16 bf16 bits (or float16 for "f16")
            buf.kpe[l, :n] = ...     # numpy [layers, rows, 64]
            client.append("req-1", l, buf.ckv[l, :n], buf.kpe[l, :n])   # by reference

    The object holds ckv [layers, rows, 512] then kpe [layers, rows, 64];
    `data` is the whole object as uint8 for other layouts (e.g.
    buf.data.view(np.uint16).reshape(n, 576): ckv = [:, :512], kpe = [:, 512:]).
    Any numpy view of it (slices with whole rows, uniform row stride) that is passed
    to this client's append / append_batch travels as a RegionRef; the server
    reads the rows while it handles the call, so rewrite a buffer only after the
    call that named it has returned.

    close() (or leaving the `with`) unregisters the region and unlinks the
    object; the local mapping goes when the last numpy view of it does.
    """

    def __init__(self, client, rows, layers=1, dtype="bf16", name=None):
        if int(rows) <= 0 or int(layers) <= 0:
            raise client_error("ShmRows needs rows > 0 and layers > 0, got rows=%r layers=%r" % (rows, layers))
        self.rows, self.layers = int(rows), int(layers)
        self.dtype = _dtype_code(dtype)
        np_dtype = np.float16 if self.dtype == pb.ROW_DTYPE_FLOAT16 else np.uint16
        ckv_bytes = self.layers * self.rows * _rows.CKV_DIM * _rows.ELEMENT_BYTES
        kpe_bytes = self.layers * self.rows * _rows.KPE_DIM * _rows.ELEMENT_BYTES
        self.size = ckv_bytes + kpe_bytes
        self.name = name or "shm-rows-%d-%s" % (os.getpid(), uuid.uuid4().hex[:12])
        self._client = client
        # The object is created (and later unlinked) through SharedMemory, but
        # mapped by an mmap of our own that is never closed explicitly: numpy
        # arrays keep a reference to their buffer object, not an export of it,
        # so closing a mapping under live views would leave them dangling. The
        # mapping goes when the last view (and this object) does.
        shm = shared_memory.SharedMemory(create=True, size=self.size)
        self.shm_name = "/" + shm.name
        try:
            self._mmap = mmap.mmap(shm._fd, self.size)
        finally:
            shm.close()
        self._shm = shm  # for unlink()
        try:
            self.region = client.register_shm(self.name, self.shm_name, 0, self.size)
        except BaseException:
            shm.unlink()
            raise
        self.data = np.ndarray((self.size,), dtype=np.uint8, buffer=self._mmap)
        self.ckv = np.ndarray((self.layers, self.rows, _rows.CKV_DIM), dtype=np_dtype, buffer=self._mmap)
        self.kpe = np.ndarray((self.layers, self.rows, _rows.KPE_DIM), dtype=np_dtype, buffer=self._mmap,
                              offset=ckv_bytes)
        self._base = self.data.__array_interface__["data"][0]
        self.closed = False
        client._add_shm_rows(self)

    def locate(self, address, extent):
        """The byte offset of [address, address + extent) in the object, or None if outside."""
        if self.closed or address < self._base or address + extent > self._base + self.size:
            return None
        return address - self._base

    def close(self):
        """Unregisters the region (if the client is still open) and unlinks the object."""
        if self.closed:
            return
        self.closed = True
        self._client._remove_shm_rows(self)
        try:
            if not self._client.closed:
                self._client.unregister(self.name)
        finally:
            # Views the caller kept stay mapped (and keep the memory) until they go.
            self.ckv = self.kpe = self.data = self._mmap = None
            self._shm.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def host_ref(array2d, shm_rows_list, row_bytes):
    """A RegionRef for a numpy [N, dim] array lying in one of `shm_rows_list`, else None.

    Needs each row's elements contiguous and a row stride that is a positive,
    even number of at least row_bytes (or a single row).
    """
    if not shm_rows_list or not isinstance(array2d, np.ndarray) or array2d.ndim != 2:
        return None
    n = array2d.shape[0]
    if array2d.strides[1] != _rows.ELEMENT_BYTES:
        return None
    stride = array2d.strides[0] if n > 1 else 0
    if n > 1 and (stride < row_bytes or stride % 2):
        return None
    address = array2d.__array_interface__["data"][0]
    extent = (n - 1) * stride + row_bytes if n else 0
    for buf in shm_rows_list:
        offset = buf.locate(address, extent)
        if offset is not None:
            return pb.RegionRef(region=buf.name, offset=offset, row_stride_bytes=stride)
    return None


# -- CUDA memory ------------------------------------------------------------


class CudaDriverError(Exception):
    pass


class _Driver:
    """The few CUDA driver calls the client needs, through ctypes on libcuda.so.1
    (present wherever a CUDA driver is; no CUDA toolkit or extra package)."""

    _instance = None
    _lock = threading.Lock()

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise client_error("CUDA tensors need the CUDA driver library libcuda.so.1: %s" % err) from None
        self._check("cuInit", self.lib.cuInit(0))

    def _name(self, code):
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return "CUresult %d" % code

    def _check(self, what, code):
        if code != 0:
            raise CudaDriverError("%s failed: %s" % (what, self._name(code)))

    def allocation(self, device_index, address):
        """(base, size, 64-byte cuIpcGetMemHandle) of the cudaMalloc allocation holding `address`.

        Runs with the device's primary context (the one torch uses) current.
        """
        dev = ctypes.c_int()
        self._check("cuDeviceGet(%d)" % device_index, self.lib.cuDeviceGet(ctypes.byref(dev), device_index))
        ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        try:
            self._check("cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2(ctx))
            try:
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                self._check("cuMemGetAddressRange(0x%x)" % address,
                            self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                             ctypes.c_uint64(address)))
                handle = (ctypes.c_char * 64)()
                code = self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base)
                if code != 0:
                    raise CudaDriverError(
                        "cuIpcGetMemHandle of the allocation at 0x%x (%d bytes) failed: %s. Only cudaMalloc "
                        "memory can be exported: torch's expandable segments "
                        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and the cudaMallocAsync backend "
                        "cannot; use the default allocator or send the rows as bytes (t.cpu())"
                        % (base.value, size.value, self._name(code)))
                return base.value, size.value, bytes(handle)
            finally:
                self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            self.lib.cuDevicePrimaryCtxRelease_v2(dev)


class CudaRegion:
    """One cudaMalloc allocation registered with the server by a Client."""

    def __init__(self, name, device_index, base, size, storage, event):
        self.name = name
        self.device_index = device_index
        self.base = base
        self.size = size
        # A storage inside the allocation: while it lives torch's caching
        # allocator cannot cudaFree the allocation under the server's mapping.
        self.storage = storage
        self.event = event  # torch.cuda.Event(interprocess=True) in "event" sync mode
        # Held by an append or a layer-wise save while it records the event and
        # the server may still wait on it, so that another thread's record on
        # another stream cannot replace it. Reentrant: several saves open in one
        # thread (a connector saving every request of a batch out of one KV
        # cache allocation) share it; and a save may end (wait()) on another
        # thread than the one that gave its layers (_ThreadShared).
        self.lock = _ThreadShared()
        # The torch stream the event was last recorded on (Client._fence): a
        # record on another stream first makes that stream wait for this one,
        # so that the latest record -- all the server waits for -- also
        # covers the writes fenced on the earlier stream.
        self.recorded_on = None

    def contains(self, address, extent):
        return self.base <= address and address + extent <= self.base + self.size


class _ThreadShared:
    """A lock one thread holds at a time, reentrantly, whose holds any thread
    may release: a threading.RLock's release must come from the thread that
    acquired it, and a layer-wise save's wait() may run elsewhere."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._owner = None
        self._count = 0

    def acquire(self):
        me = threading.get_ident()
        with self._cond:
            while self._count and self._owner != me:
                self._cond.wait()
            self._owner = me
            self._count += 1

    def release(self):
        with self._cond:
            if self._count == 0:
                raise RuntimeError("release of a region lock that is not held")
            self._count -= 1
            if self._count == 0:
                self._owner = None
                self._cond.notify_all()


def is_cuda_tensor(x):
    return _rows._is_torch(x) and getattr(x, "is_cuda", False)


def torch_row_dtype(t, name):
    import torch

    if t.dtype == torch.float16:
        return pb.ROW_DTYPE_FLOAT16
    if t.dtype == torch.bfloat16:
        return pb.ROW_DTYPE_BFLOAT16
    raise client_error("%s has dtype %s; expected torch.float16 or torch.bfloat16" % (name, t.dtype))


def cuda_layer_views(t, dim, name, leading):
    """(address, rows, row_stride_bytes) per leading index of a CUDA tensor [*leading, N, dim]."""
    if not leading and t.dim() == 1 and t.shape[0] == dim:
        t = t.reshape(1, dim)
    want = len(leading) + 2
    if t.dim() != want or t.shape[-1] != dim or tuple(t.shape[:-2]) != tuple(leading):
        shape = ", ".join([str(d) for d in leading] + ["N", str(dim)])
        raise client_error("%s has shape %s; expected [%s]" % (name, list(t.shape), shape))
    n = t.shape[-2]
    row_bytes = dim * _rows.ELEMENT_BYTES
    if n > 0 and t.stride(-1) != 1:
        raise client_error("%s: the %d channels of a row are not contiguous (stride %d elements); the server "
                           "reads each row as one run: pass %s.contiguous()" % (name, dim, t.stride(-1), name))
    stride = t.stride(-2) * _rows.ELEMENT_BYTES if n > 1 else 0
    if n > 1 and stride < row_bytes:
        raise client_error("%s: rows overlap (row stride %d bytes < %d bytes of a row, e.g. an expanded "
                           "tensor): pass %s.contiguous()" % (name, stride, row_bytes, name))
    if not leading:  # one layer (a layer-wise save's case): no view to make, ~5 us less a tensor
        return [(t.data_ptr(), n, stride)], n
    return [(t[i].data_ptr(), n, stride) for i in range(t.shape[0])], n
