"""CUDA torch tensors appended by reference (CUDA IPC) to `mlakv-server
--allow_ipc --device cuda:0`: the stored bytes equal those of the same rows
sent as bytes; strided (interleaved [N,576]) rows, multi-layer appends,
append_batch, fp16, the "event" sync mode, one registration per cudaMalloc
allocation (torch's caching allocator puts many tensors in one), release, and
the client-side refusals.

Not named test_*.py: `unittest discover` (ctest python_client) leaves it out;
ctest runs it as python_client_cuda (label gpu). Without torch, CUDA or a GPU
every test is skipped with the reason and the script exits 77, which ctest
reports as skipped (SKIP_RETURN_CODE), never as passed.

    MLAKV_SERVER=.../mlakv-server MLAKV_PY_GEN=.../gen PYTHONPATH=client/python \\
        python3 client/python/tests/cuda_region_test.py
"""

import os
import sys
import unittest
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402

import mlakv  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from server_test_case import CALL_TIMEOUT_S, RegionServerTestCase, WireSpy, cuda_missing  # noqa: E402

SCALES = dict(ckv_scale=0.01, kpe_scale=0.05)
EXIT_ALL_SKIPPED = 77


SKIP_REASON = cuda_missing()


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class CudaRegionTest(RegionServerTestCase):
    server_device = "cuda:0"

    @classmethod
    def setUpClass(cls):
        import torch

        cls.torch = torch
        super().setUpClass()  # self.client: bytes and checks

    def setUp(self):
        super().setUp()
        self.gen = self.torch.Generator(device="cuda:0").manual_seed(zlib.crc32(self.id().encode()))

    def rows(self, n, dtype=None, lead=()):
        t = self.torch
        dtype = dtype or t.bfloat16
        ckv = (t.randn(*lead, n, 512, device="cuda:0", generator=self.gen) * 2).to(dtype)
        kpe = (t.randn(*lead, n, 64, device="cuda:0", generator=self.gen) * 2).to(dtype)
        return ckv, kpe

    def test_contiguous_rows_store_the_bytes_of_a_bytes_append(self):
        sent = WireSpy(self.c).appends
        ckv, kpe = self.rows(300)
        resp = self.c.append("cuda", 0, ckv, kpe, **SCALES)
        self.assertEqual(resp.rows_written, 300)
        self.assertEqual(len(sent), 1)
        layer = sent[0].layers[0]
        self.assertEqual((layer.ckv, layer.kpe), (b"", b""))
        self.assertTrue(layer.ckv_ref.region and layer.kpe_ref.region)
        self.assertEqual(layer.ckv_ref.row_stride_bytes, 1024)
        self.client.append("bytes", 0, ckv.cpu(), kpe.cpu(), **SCALES)
        self.assert_same_bytes("cuda", "bytes", 0)
        regions = {r.name: r for r in self.client.regions()}
        for name in self.c.cuda_regions():
            self.assertEqual(regions[name].kind, mlakv.pb.REGION_KIND_CUDA)
            self.assertEqual(regions[name].device_id, 0)
            self.assertFalse(regions[name].has_event)

    def test_interleaved_rows_and_fp16(self):
        t = self.torch
        kv = (t.randn(77, 576, device="cuda:0", generator=self.gen) * 3).to(t.float16)
        sent = WireSpy(self.c).appends
        self.c.append("strided", 1, kv[:, :512], kv[:, 512:], **SCALES)
        layer = sent[0].layers[0]
        self.assertEqual((layer.ckv_ref.row_stride_bytes, layer.kpe_ref.row_stride_bytes), (1152, 1152))
        self.assertEqual(layer.kpe_ref.offset - layer.ckv_ref.offset, 1024)
        self.assertEqual(sent[0].dtype, mlakv.pb.ROW_DTYPE_FLOAT16)
        self.client.append("bytes", 1, kv[:, :512].cpu(), kv[:, 512:].cpu(), **SCALES)
        self.assert_same_bytes("strided", "bytes", 1)

    def test_multi_layer_append_batch_and_one_region_per_allocation(self):
        ckv, kpe = self.rows(40, lead=(3,))
        self.c.append("ml", [0, 1, 2], ckv, kpe, **SCALES)
        for i in range(3):
            self.client.append("ml-bytes-%d" % i, i, ckv[i].cpu(), kpe[i].cpu(), **SCALES)
            self.assert_same_bytes("ml", "ml-bytes-%d" % i, i)
        # A decode step: many small tensors; the caching allocator packs them
        # into few cudaMalloc blocks, each registered once.
        before = len(self.c.cuda_regions())
        steps = [{l: self.rows(1) for l in range(3)} for _ in range(8)]
        items = [mlakv.SequenceRows("dec-%d" % i, steps[i], 0) for i in range(8)]
        resp = self.c.append_batch(items, **SCALES)
        self.assertEqual(resp.rows_written, 24)
        registered = len(self.c.cuda_regions()) - before
        self.assertLess(registered, 48, "48 small tensors should share allocations")
        self.assertEqual(sorted(self.c.cuda_regions()),
                         sorted(r.name for r in self.client.regions() if r.kind == mlakv.pb.REGION_KIND_CUDA))
        for i in range(8):
            for l in range(3):
                self.client.append("dec-bytes-%d-%d" % (i, l), l, steps[i][l][0].cpu(), steps[i][l][1].cpu(),
                                   **SCALES)
                self.assert_same_bytes("dec-%d" % i, "dec-bytes-%d-%d" % (i, l), l)
        # Appending the same tensors again registers nothing new.
        count = len(self.c.cuda_regions())
        self.c.append("ml-again", [0, 1, 2], ckv, kpe, **SCALES)
        self.assertEqual(len(self.c.cuda_regions()), count)
        self.c.release_cuda_regions()
        self.assertEqual(self.c.cuda_regions(), [])
        self.assertEqual([r for r in self.client.regions() if r.kind == mlakv.pb.REGION_KIND_CUDA], [])

    def test_decode_step_from_one_tensor_per_layer(self):
        # AppendBatch's compact form by reference: [layers, sequences, dim]
        # tensors, one region range per layer, all layers in one launch.
        sent = WireSpy(self.c).batches
        ckv, kpe = self.rows(16, lead=(3,))
        resp = self.c.decode_step(["cd-%d" % i for i in range(16)], ckv, kpe, starts=[0] * 16, **SCALES)
        self.assertEqual(resp.rows_written, 48)
        self.assertEqual([(l.ckv, l.kpe, bool(l.ckv_ref.region)) for l in sent[0].batch_layers], [(b"", b"", True)] * 3)
        for i in (0, 7, 15):
            for l in range(3):
                self.client.append("cd-bytes", l, ckv[l, i:i + 1].cpu(), kpe[l, i:i + 1].cpu(), start=0, **SCALES)
                self.assert_same_bytes("cd-%d" % i, "cd-bytes", l)
            self.client.free("cd-bytes")

    def test_event_mode_writes_still_queued_when_the_call_starts(self):
        t = self.torch
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, cuda_sync="event") as c:
            for i in range(3):
                # Queue a long kernel chain that ends writing the rows, then append at once:
                # the server's stream waits on the recorded event.
                big = t.randn(4096, 4096, device="cuda:0", generator=self.gen)
                for _ in range(4):
                    big = big @ big / 64
                ckv = (t.randn(200, 512, device="cuda:0", generator=self.gen) + big[:200, :1]).to(t.bfloat16)
                kpe = (t.randn(200, 64, device="cuda:0", generator=self.gen) + big[:200, :1]).to(t.bfloat16)
                c.append("event-%d" % i, 0, ckv, kpe, **SCALES)
                self.client.append("event-bytes-%d" % i, 0, ckv.cpu(), kpe.cpu(), **SCALES)
                self.assert_same_bytes("event-%d" % i, "event-bytes-%d" % i, 0)
            self.assertTrue(all(r.has_event for r in self.client.regions() if r.name in c.cuda_regions()))

    def test_save_of_views_and_of_other_allocations(self):
        # Layers 0, 1, 3 and 5 are views of one [6, N, dim] buffer (each
        # layer's refs from the last one's layout); layer 2 lies in an
        # allocation of its own (64 MB: its own cudaMalloc block), layer 4
        # is strided; every layer stores what the bytes path stores.
        t = self.torch
        ckv, kpe = self.rows(300, lead=(6,))
        own = t.empty(64 << 20, dtype=t.uint8, device="cuda:0")
        own_ckv = own[:300 * 1024].view(t.bfloat16).view(300, 512)
        own_ckv.copy_(ckv[2])
        kv = t.cat([ckv[4], kpe[4]], dim=1)  # [300, 576]: rows 1152 bytes apart
        sources = {l: (ckv[l], kpe[l]) for l in (0, 1, 3, 5)}
        sources[2] = (own_ckv, kpe[2])
        sources[4] = (kv[:, :512], kv[:, 512:])
        before = len(self.c.cuda_regions())
        with self.c.save("views", **SCALES) as s:
            for l in range(6):
                s.layer(l, *sources[l])
        self.assertEqual(list(self.c.sequence("views").layer_lengths)[:6], [300] * 6)
        self.assertGreaterEqual(len(self.c.cuda_regions()), before + 1)  # the 64 MB block at least
        for l in range(6):
            self.client.append("views-bytes", l, sources[l][0].cpu(), sources[l][1].cpu(), start=0, **SCALES)
            self.assert_same_bytes("views", "views-bytes", l)

    def test_save_of_layers_whose_tensors_are_dropped_at_once(self):
        # A forward pass's layer outputs are temporaries: each layer's pair is
        # dropped right after s.layer, and the caching allocator may hand its
        # block to the next layer's; the server reads the rows only when the
        # save ends. The save keeps them alive until then.
        t = self.torch
        for sync in ("event", "stream"):
            with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, cuda_sync=sync) as c:
                host = []
                with c.save("dropped-" + sync, **SCALES) as s:
                    for l in range(61):
                        h = t.randn(300, 640, device="cuda:0", generator=self.gen) * (l + 1) / 8
                        ckv, kpe = h[:, :512].to(t.bfloat16).contiguous(), h[:, 512:576].to(t.bfloat16).contiguous()
                        host.append((ckv.cpu(), kpe.cpu()))
                        s.layer(l, ckv, kpe)
                        del h, ckv, kpe
                for l in range(61):
                    self.client.append("dropped-bytes-" + sync, l, *host[l], start=0, **SCALES)
                    self.assert_same_bytes("dropped-" + sync, "dropped-bytes-" + sync, l)

    def test_save_with_layers_on_two_streams_of_one_allocation(self):
        # Layer 0 ends a long chain on stream A, layer 1 is written at once on
        # stream B, both in one buffer: one interprocess event per allocation,
        # recorded last on B, must still cover A's writes (B waits on A's
        # record first).
        t = self.torch
        n = 300
        w = t.randn(4096, 4096, device="cuda:0", generator=self.gen).to(t.bfloat16) / 64
        a, b = t.cuda.Stream(), t.cuda.Stream()
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, cuda_sync="event") as c:
            for k in range(3):
                buf = t.zeros(2, n, 576, device="cuda:0", dtype=t.bfloat16)
                t.cuda.synchronize()
                s = c.save("streams-%d" % k, num_layers=2, **SCALES)
                with t.cuda.stream(a):
                    x = t.randn(4096, 4096, device="cuda:0", generator=self.gen).to(t.bfloat16)
                    for _ in range(40):
                        x = (x @ w).clamp_(-4, 4)
                    buf[0].copy_(x[:n, :576])
                    s.layer(0, buf[0, :, :512], buf[0, :, 512:])
                with t.cuda.stream(b):
                    buf[1].fill_(1.5)
                    s.layer(1, buf[1, :, :512], buf[1, :, 512:])
                s.wait()
                t.cuda.synchronize()
                for l in range(2):
                    self.client.append("streams-bytes-%d" % k, l, buf[l, :, :512].cpu(), buf[l, :, 512:].cpu(),
                                       start=0, **SCALES)
                    self.assert_same_bytes("streams-%d" % k, "streams-bytes-%d" % k, l)

    def test_save_waited_for_on_another_thread(self):
        # The region locks a save holds (event mode) are released by wait()
        # on whichever thread calls it; another thread's append on the same
        # allocation then goes ahead.
        import threading

        ckv, kpe = self.rows(300, lead=(2,))
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, cuda_sync="event") as c:
            s = c.save("other-thread", num_layers=2, **SCALES)
            for l in range(2):
                s.layer(l, ckv[l], kpe[l])
            out = {}

            def run(key, f):
                try:
                    out[key] = f()
                except BaseException as e:  # noqa: BLE001 -- reported by the assertion below
                    out[key] = e

            waiter = threading.Thread(target=run, args=("wait", s.wait))
            waiter.start()
            waiter.join(60)
            self.assertFalse(isinstance(out.get("wait"), BaseException), out)
            self.assertEqual(list(out["wait"].sequence.layer_lengths)[:2], [300, 300])
            appender = threading.Thread(target=run, args=("append", lambda: c.append(
                "other-thread-2", 0, ckv[0], kpe[0], start=0, **SCALES)), daemon=True)
            appender.start()
            appender.join(30)
            self.assertFalse(appender.is_alive(), "an append on the save's allocation waits for ever")
            self.assertFalse(isinstance(out.get("append"), BaseException), out)
        for l in range(2):
            self.client.append("other-thread-bytes", l, ckv[l].cpu(), kpe[l].cpu(), start=0, **SCALES)
            self.assert_same_bytes("other-thread", "other-thread-bytes", l)

    def test_client_side_refusals(self):
        t = self.torch
        ckv, kpe = self.rows(4)
        wide = t.zeros(4, 1024, device="cuda:0", dtype=t.bfloat16)
        cases = [
            (ckv, kpe.cpu(), "not"),                                  # one on the GPU, one not
            (ckv.float(), kpe.float(), "dtype"),                      # float32
            (wide[:, ::2], kpe, "contiguous"),                        # channels 2 apart
            (ckv[:1].expand(4, 512), kpe, "overlap"),                 # stride-0 rows
            (ckv[:, :256], kpe, "shape"),                             # wrong width
            (ckv, kpe.to(t.float16), "dtype"),                        # mixed dtypes
        ]
        for c_in, k_in, words in cases:
            with self.subTest(words=words):
                with self.assertRaises(mlakv.Error) as ctx:
                    self.c.append("refused", 0, c_in, k_in, **SCALES)
                self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT, str(ctx.exception))
                self.assertTrue(ctx.exception.message.startswith("client: "), ctx.exception.message)
                self.assertIn(words, ctx.exception.message)
        self.assertEqual(self.c.cuda_regions(), [])
        with self.assertRaises(mlakv.Error) as ctx:
            self.client.sequence("refused")
        self.assertEqual(ctx.exception.code, grpc.StatusCode.NOT_FOUND)


@unittest.skipIf(SKIP_REASON is not None, SKIP_REASON or "")
class CudaRegionCpuPoolTest(unittest.TestCase):
    def test_cuda_rows_to_a_cpu_pool_are_failed_precondition(self):
        import torch

        with ServerProcess("--allow_ipc", device="cpu") as server:
            with mlakv.Client(server.target, timeout=CALL_TIMEOUT_S) as c:
                ckv = torch.zeros(2, 512, device="cuda:0", dtype=torch.bfloat16)
                kpe = torch.zeros(2, 64, device="cuda:0", dtype=torch.bfloat16)
                with self.assertRaises(mlakv.Error) as ctx:
                    c.append("s", 0, ckv, kpe, **SCALES)
                self.assertEqual(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION, str(ctx.exception))
                self.assertIn("cpu", ctx.exception.message)


if __name__ == "__main__":
    result = unittest.main(verbosity=2, exit=False).result
    ran = result.testsRun - len(result.skipped)
    if not result.wasSuccessful():
        sys.exit(1)
    if ran == 0:
        print("all %d tests skipped: %s" % (result.testsRun, SKIP_REASON), file=sys.stderr)
        sys.exit(EXIT_ALL_SKIPPED)
    sys.exit(0)
