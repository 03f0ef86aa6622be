"""The CUDA-tensor path of Client.append without a GPU: CPU torch tensors stand
in for CUDA ones, a fake driver reports which "allocation" holds an address
(a big uint8 tensor plays a cudaMalloc block of torch's caching allocator),
and the requests are captured instead of sent. Checks the RegionRefs (offsets
from the allocation base, row strides, one per layer), one registration per
allocation, the storage kept alive while registered, everything validated
before anything is registered, the device mapping, the stream fence, release.

Needs torch (any build; no CUDA). Without torch every test is skipped and the
script exits 77, which ctest reports as skipped. The real thing, on a GPU
against the server, is cuda_region_test.py.
"""

import os
import sys
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
import numpy  # noqa: E402

import mlakv  # noqa: E402
from mlakv import regions as _regions  # noqa: E402
from mlakv import rows as _rows  # noqa: E402

EXIT_ALL_SKIPPED = 77

try:
    import torch
    SKIP_REASON = None
except ImportError as err:
    torch = None
    SKIP_REASON = "torch is not importable (%s)" % err


class FakeDriver:
    """Allocations are the byte ranges of tensors the test declares."""

    def __init__(self):
        self.allocations = []  # (base, size)
        self.calls = 0
        self.fail = None

    def add(self, t):
        self.allocations.append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    def allocation(self, device_index, address):
        self.calls += 1
        if self.fail:
            raise _regions.CudaDriverError(self.fail)
        for base, size in self.allocations:
            if base <= address < base + size:
                return base, size, base.to_bytes(8, "little") * 8
        raise _regions.CudaDriverError("cuMemGetAddressRange(0x%x) failed: CUDA_ERROR_INVALID_VALUE" % address)


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class CudaBookkeepingTest(unittest.TestCase):
    def setUp(self):
        self.driver = FakeDriver()
        patches = [
            mock.patch.object(_regions._Driver, "get", classmethod(lambda cls: self.driver)),
            mock.patch.object(_regions, "is_cuda_tensor", lambda x: _rows._is_torch(x)),
        ]
        for p in patches:
            p.start()
            self.addCleanup(p.stop)
        self.segment = self.driver.add(torch.zeros(1 << 20, dtype=torch.uint8))  # a 1 MiB "cudaMalloc block"
        self.used = 0
        self.c = self.client()

    def client(self, **kwargs):
        c = mlakv.Client("127.0.0.1:1", cuda_sync=kwargs.pop("cuda_sync", "none"), **kwargs)
        c.sent, c.registered, c.unregistered = [], [], []

        def append(requests, **kw):
            c.sent.extend(requests)
            return mlakv.pb.AppendResponse(rows_written=sum(m.row_count * len(m.layers) for m in c.sent))

        def batch(request, **kw):
            c.sent.append(request)
            return mlakv.pb.AppendBatchResponse()

        def register(request, **kw):
            c.registered.append(request)
            return mlakv.pb.Region(name=request.name, kind=mlakv.pb.REGION_KIND_CUDA, byte_size=request.byte_size)

        def unregister(request, **kw):
            c.unregistered.append(request.name)
            return mlakv.pb.UnregisterRegionResponse()

        c._stub.Append, c._stub.AppendBatch = append, batch
        c._stub.RegisterCudaRegion, c._stub.UnregisterRegion = register, unregister
        self.addCleanup(c.close)
        return c

    def carve(self, *shape, dtype=None):
        """A tensor inside the segment (as the caching allocator would place it)."""
        dtype = dtype or torch.bfloat16
        n = 1
        for d in shape:
            n *= d
        start = (self.used + 511) // 512 * 512
        self.used = start + 2 * n
        t = self.segment[start:self.used].view(dtype).view(*shape)
        t.copy_(torch.randn(*shape).to(dtype))
        return t

    def offset(self, t):
        return t.data_ptr() - self.segment.data_ptr()

    def test_rows_in_one_block_register_it_once(self):
        ckv, kpe = self.carve(10, 512), self.carve(10, 64)
        self.c.append("s", 3, ckv, kpe, start=0, ckv_scale=0.5, kpe_scale=0.25)
        self.assertEqual(len(self.c.registered), 1)
        reg = self.c.registered[0]
        self.assertEqual((len(reg.raw_handle), reg.byte_size, reg.device_id, reg.raw_event_handle),
                         (64, 1 << 20, 0, b""))
        self.assertEqual(len(self.c.sent), 1)
        msg = self.c.sent[0]
        self.assertEqual((msg.row_count, msg.dtype, msg.start), (10, mlakv.pb.ROW_DTYPE_BFLOAT16, 0))
        layer = msg.layers[0]
        self.assertEqual((layer.layer, layer.ckv, layer.kpe, layer.ckv_scale), (3, b"", b"", 0.5))
        self.assertEqual((layer.ckv_ref.region, layer.ckv_ref.offset, layer.ckv_ref.row_stride_bytes),
                         (reg.name, self.offset(ckv), 1024))
        self.assertEqual((layer.kpe_ref.region, layer.kpe_ref.offset, layer.kpe_ref.row_stride_bytes),
                         (reg.name, self.offset(kpe), 128))
        # Later tensors in the same block: no driver call, no registration.
        calls = self.driver.calls
        more_ckv, more_kpe = self.carve(1, 512), self.carve(64)  # one row, given as [64]
        self.c.append("s", 3, more_ckv, more_kpe, start=10)
        self.assertEqual((self.driver.calls, len(self.c.registered)), (calls, 1))
        self.assertEqual(self.c.sent[1].layers[0].kpe_ref.offset, self.offset(more_kpe))
        self.assertEqual(self.c.sent[1].layers[0].kpe_ref.row_stride_bytes, 0)  # a single row
        self.assertEqual(self.c.cuda_regions(), [reg.name])

    def test_strides_layers_and_other_blocks(self):
        kv = self.carve(7, 576, dtype=torch.float16)
        self.c.append("il", 0, kv[:, :512], kv[:, 512:], start=0)
        layer = self.c.sent[0].layers[0]
        self.assertEqual((layer.ckv_ref.row_stride_bytes, layer.kpe_ref.row_stride_bytes), (1152, 1152))
        self.assertEqual(layer.kpe_ref.offset, self.offset(kv) + 1024)
        self.assertEqual(self.c.sent[0].dtype, mlakv.pb.ROW_DTYPE_FLOAT16)
        # [L, N, dim]: one reference per layer, each at its own offset.
        ckv, kpe = self.carve(3, 5, 512), self.carve(3, 5, 64)
        self.c.append("ml", [4, 5, 6], ckv, kpe, start=0)
        refs = [(l.layer, l.ckv_ref.offset, l.kpe_ref.offset) for l in self.c.sent[1].layers]
        self.assertEqual(refs, [(4 + i, self.offset(ckv[i]), self.offset(kpe[i])) for i in range(3)])
        # A tensor in another block registers that block.
        other = self.driver.add(torch.zeros(5, 512, dtype=torch.bfloat16))
        self.c.append("other", 0, other, kpe[0], start=0)
        self.assertEqual(len(self.c.registered), 2)
        self.assertEqual(self.c.sent[2].layers[0].ckv_ref.offset, 0)
        self.assertNotEqual(self.c.sent[2].layers[0].ckv_ref.region, self.c.sent[2].layers[0].kpe_ref.region)

    def test_append_batch_and_device_mapping(self):
        c = self.client(cuda_device_ids={0: 3})
        items = [("a", {0: (self.carve(1, 512), self.carve(1, 64)), 1: (self.carve(1, 512), self.carve(1, 64))}, 0),
                 ("b", {0: (self.carve(1, 512), self.carve(1, 64))}, 7)]
        c.append_batch(items, ckv_scale=1, kpe_scale=1)
        self.assertEqual([r.device_id for r in c.registered], [3])
        req = c.sent[0]
        self.assertEqual([(s.sequence, s.start, s.row_count, len(s.layers)) for s in req.sequences],
                         [("a", 0, 1, 2), ("b", 7, 1, 1)])
        self.assertEqual(req.sequences[0].layers[1].ckv_ref.offset, self.offset(items[0][1][1][0]))
        self.assertEqual(req.dtype, mlakv.pb.ROW_DTYPE_BFLOAT16)
        bad = self.client(cuda_device_ids={1: 0})
        e = self.assert_client_error(bad.append, "s", 0, self.carve(1, 512), self.carve(1, 64), start=0)
        self.assertIn("cuda_device_ids", e.message)

    def test_everything_is_checked_before_registering(self):
        ckv, kpe = self.carve(4, 512), self.carve(4, 64)
        wide = self.carve(4, 1024)
        cases = [
            ((ckv, kpe.to(torch.float16)), "dtype"),
            ((ckv, self.carve(3, 64)), "rows"),
            ((wide[:, ::2], kpe), "contiguous"),
            ((ckv[:1].expand(4, 512), kpe), "overlap"),
            ((ckv[:, :256], kpe), "shape"),
            ((ckv.float(), kpe.float()), "dtype"),
        ]
        for (a, b), words in cases:
            with self.subTest(words=words):
                e = self.assert_client_error(self.c.append, "s", 0, a, b, start=0)
                self.assertIn(words, e.message)
        e = self.assert_client_error(self.c.append, "s", 0, ckv, kpe, start=0, dtype="f16")
        self.assertIn("dtype", e.message)
        self.assertEqual((self.c.registered, self.c.sent, self.driver.calls), ([], [], 0))

    def test_driver_errors_are_client_errors(self):
        self.driver.fail = "cuIpcGetMemHandle of the allocation at 0x10 (64 bytes) failed: CUDA_ERROR_NOT_SUPPORTED"
        e = self.assert_client_error(self.c.append, "s", 0, self.carve(2, 512), self.carve(2, 64), start=0)
        self.assertIn("CUDA_ERROR_NOT_SUPPORTED", e.message)
        self.assertEqual(self.c.registered, [])

    def test_registered_storage_is_kept_until_release(self):
        ckv = torch.zeros(2, 512, dtype=torch.bfloat16)
        kpe = torch.zeros(2, 64, dtype=torch.bfloat16)
        self.driver.add(ckv)
        self.driver.add(kpe)
        self.c.append("s", 0, ckv, kpe, start=0)
        self.assertEqual(len(self.c.registered), 2)
        # Each registration holds a storage of its allocation (so that torch
        # cannot free it under the server's mapping).
        self.assertEqual(sorted(r.storage.data_ptr() for r in self.c._cuda_regions),
                         sorted([ckv.data_ptr(), kpe.data_ptr()]))
        self.c.release_cuda_regions()
        self.assertEqual(sorted(self.c.unregistered), sorted(r.name for r in self.c.registered))
        self.assertEqual(self.c.cuda_regions(), [])
        self.assertEqual(self.c._cuda_regions, [])
        # The next append registers again.
        self.c.append("s", 0, ckv, kpe, start=2)
        self.assertEqual(len(self.c.registered), 4)

    def test_unregister_by_name_forgets_the_allocation(self):
        self.c.append("s", 0, self.carve(1, 512), self.carve(1, 64), start=0)
        name = self.c.cuda_regions()[0]
        self.c.unregister(name)
        self.assertEqual(self.c.cuda_regions(), [])
        self.c.append("s", 0, self.carve(1, 512), self.carve(1, 64), start=1)
        self.assertEqual(len(self.c.registered), 2)

    def test_close_unregisters(self):
        c = self.client()
        c.append("s", 0, self.carve(1, 512), self.carve(1, 64), start=0)
        c.close()
        self.assertEqual(c.unregistered, [c.registered[0].name])

    def test_stream_sync_before_the_call(self):
        c = self.client(cuda_sync="stream")
        order = []

        class Stream:
            def synchronize(self):
                order.append("sync")

        real_append = c._stub.Append
        c._stub.Append = lambda requests, **kw: (order.append("append"), real_append(requests, **kw))[1]
        with mock.patch.object(torch.cuda, "current_stream", lambda device=None: Stream()):
            c.append("s", 0, self.carve(2, 512), self.carve(2, 64), start=0)
        self.assertEqual(order, ["sync", "append"])
        self.assert_client_error(mlakv.Client, "127.0.0.1:1", cuda_sync="sometimes")

    def refs(self, prepared):
        return [(r.region, r.offset, r.row_stride_bytes) for r in prepared.ckv + prepared.kpe]

    def test_a_layer_laid_out_like_the_last_skips_the_checks(self):
        # A layer-wise save's layers: views of one [layers, N, dim] buffer.
        ckv, kpe = self.carve(4, 10, 512), self.carve(4, 10, 64)
        first, like = self.c._prepare_layer(None, ckv[0], kpe[0])
        self.assertIsNotNone(like)
        self.assertEqual((len(self.c.registered), self.driver.calls), (1, 1))
        name = self.c.registered[0].name
        for i in (1, 2, 3):
            with mock.patch.object(self.c, "_prepare", side_effect=AssertionError("the checks ran again")):
                prepared, again = self.c._prepare_layer(like, ckv[i], kpe[i])
            self.assertIs(again, like)
            self.assertEqual(self.refs(prepared), [(name, self.offset(ckv[i]), 1024), (name, self.offset(kpe[i]), 128)])
            self.assertEqual((prepared.rows, prepared.dtype, prepared.cuda), (10, first.dtype, first.cuda))
            # What the full checks give for the same pair.
            self.assertEqual(self.refs(prepared), self.refs(self.c._prepare(ckv[i], kpe[i])))
        self.assertEqual((len(self.c.registered), self.driver.calls), (1, 1))

    def test_a_layer_laid_out_otherwise_is_checked_in_full(self):
        ckv, kpe = self.carve(3, 10, 512), self.carve(3, 10, 64)
        _, like = self.c._prepare_layer(None, ckv[0], kpe[0])
        kv = self.carve(10, 576)
        other_block = self.driver.add(torch.zeros(10, 512, dtype=torch.bfloat16))
        cases = [
            ("other row count", self.carve(11, 512), self.carve(11, 64)),
            ("other dtype", self.carve(10, 512, dtype=torch.float16), self.carve(10, 64, dtype=torch.float16)),
            ("other strides", kv[:, :512], kv[:, 512:]),
            ("host rows", numpy.zeros((10, 512), dtype=numpy.uint16), kpe[1]),
            ("another allocation", other_block, kpe[1]),
        ]
        for what, c_in, k_in in cases:
            with self.subTest(what=what):
                self.assertIsNone(self.c._prepare_like(like, c_in, k_in))
        # In another allocation: registered, and a layout of its own.
        prepared, other = self.c._prepare_layer(like, other_block, kpe[1])
        self.assertIsNot(other, like)
        self.assertEqual(len(self.c.registered), 2)
        self.assertEqual(prepared.ckv[0].region, self.c.registered[1].name)
        # Refused by the full checks as before (the caller names the layer).
        with self.assertRaises(mlakv.Error) as ctx:
            self.c._prepare_layer(like, ckv[1], self.carve(10, 64, dtype=torch.float16))
        self.assertIn("dtype", ctx.exception.message)

    def test_a_region_unregistered_between_layers_is_looked_up_again(self):
        ckv, kpe = self.carve(3, 10, 512), self.carve(3, 10, 64)
        _, like = self.c._prepare_layer(None, ckv[0], kpe[0])
        self.c.unregister(self.c.cuda_regions()[0])
        prepared, again = self.c._prepare_layer(like, ckv[1], kpe[1])
        self.assertIsNot(again, like)
        self.assertEqual(len(self.c.registered), 2)
        self.assertEqual(prepared.ckv[0].region, self.c.registered[1].name)
        self.c.release_cuda_regions()
        prepared, last = self.c._prepare_layer(again, ckv[2], kpe[2])
        self.assertIsNot(last, again)
        self.assertEqual(len(self.c.registered), 3)
        self.assertEqual(prepared.kpe[0].region, self.c.registered[2].name)

    def assert_client_error(self, fn, *args, **kwargs):
        with self.assertRaises(mlakv.Error) as ctx:
            fn(*args, **kwargs)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT, str(ctx.exception))
        self.assertTrue(ctx.exception.message.startswith("client: "), ctx.exception.message)
        return ctx.exception


if __name__ == "__main__":
    result = unittest.main(verbosity=2, exit=False).result
    if not result.wasSuccessful():
        sys.exit(1)
    if result.testsRun == len(result.skipped):
        print("all %d tests skipped: %s" % (result.testsRun, SKIP_REASON), file=sys.stderr)
        sys.exit(EXIT_ALL_SKIPPED)
    sys.exit(0)
