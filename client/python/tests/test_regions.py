"""Regions through the Python client against a real `mlakv-server --allow_ipc`
(cpu backend, host shared memory): register_shm / regions / unregister,
ShmRows views appended by reference (packed, strided, multi-layer,
append_batch, RegionRows) storing exactly what the same rows sent as bytes
store, what travels on the wire (references, not bytes), the refusals with
their codes, and a server without --allow_ipc.

CUDA tensors are covered by cuda_region_test.py (ctest label gpu).
"""

import threading
import unittest
from multiprocessing import shared_memory

import grpc
import numpy as np

import mlakv
from server_test_case import CALL_TIMEOUT_S, RegionServerTestCase, ServerTestCase, WireSpy, random_rows

SCALES = dict(ckv_scale=0.01, kpe_scale=0.05)


class RegionTestCase(RegionServerTestCase):
    """self.spy records what self.c sends."""

    def setUp(self):
        super().setUp()
        self.spy = WireSpy(self.c)


class RegisterShmTest(RegionTestCase):
    def test_register_list_unregister(self):
        shm = shared_memory.SharedMemory(create=True, size=1 << 16)
        try:
            region = self.c.register_shm("r-offset", "/" + shm.name, offset=4096, size=8192)
            self.assertEqual((region.name, region.kind, region.byte_size, region.shm_name, region.shm_offset),
                             ("r-offset", mlakv.pb.REGION_KIND_SHM, 8192, "/" + shm.name, 4096))
            rest = self.c.register_shm("r-rest", "/" + shm.name, offset=1024)  # size 0: to the end
            self.assertEqual(rest.byte_size, (1 << 16) - 1024)
            listed = self.c.regions()
            self.assertEqual([r.name for r in listed], ["r-offset", "r-rest"])
            self.assertEqual([r.appends_in_flight for r in listed], [0, 0])
            self.assertEqual(self.c.unregister("r-offset"), 0)
            self.assertEqual([r.name for r in self.c.regions()], ["r-rest"])
            self.assertCode(grpc.StatusCode.NOT_FOUND, self.c.unregister, "r-offset")
            self.c.unregister("r-rest")
        finally:
            shm.close()
            shm.unlink()

    def test_registration_refusals(self):
        shm = shared_memory.SharedMemory(create=True, size=4096)
        try:
            self.assertCode(grpc.StatusCode.NOT_FOUND, self.c.register_shm, "x", "/mlakv-py-no-such-object")
            self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.c.register_shm, "x", "/" + shm.name, 0, 8192)
            self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.c.register_shm, "x", "/" + shm.name, 8192)
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.register_shm, "x", "no-slash")
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.register_shm, "", "/" + shm.name)
            self.c.register_shm("dup", "/" + shm.name)
            self.assertCode(grpc.StatusCode.ALREADY_EXISTS, self.c.register_shm, "dup", "/" + shm.name)
            self.c.unregister("dup")
        finally:
            shm.close()
            shm.unlink()

    def test_register_cuda_checks_and_codes(self):
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.register_cuda, "c", b"\0" * 63, 0, 4096)
        self.assertTrue(e.message.startswith("client: "), e.message)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.register_cuda, "c", b"\0" * 64, 0, 4096,
                        event_handle=b"\0" * 10)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.register_cuda, "c", "not bytes", 0, 4096)
        # 64 bytes that are no handle reach the server: CUDA refuses them where a
        # GPU is visible (INVALID_ARGUMENT), else there is none (FAILED_PRECONDITION).
        with self.assertRaises(mlakv.Error) as ctx:
            self.c.register_cuda("c", b"\x5a" * 64, 0, 4096)
        self.assertIn(ctx.exception.code, (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
                      str(ctx.exception))
        self.assertFalse(ctx.exception.message.startswith("client: "), ctx.exception.message)

    def test_export_pool_of_a_cpu_pool(self):
        e = self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.c.export_pool)
        self.assertIn("cpu", e.message)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.c.export_pool, "no-such-pool")


class ShmRowsTest(RegionTestCase):
    def test_views_travel_by_reference_and_store_the_same_bytes(self):
        rng = np.random.default_rng(21)
        n = 70
        ckv, kpe = random_rows(rng, n)
        with self.c.shm_rows(rows=128, layers=2) as buf:
            self.assertEqual([r.name for r in self.c.regions()], [buf.name])
            self.assertEqual(buf.ckv.shape, (2, 128, 512))
            self.assertEqual(buf.kpe.shape, (2, 128, 64))
            self.assertEqual(buf.ckv.dtype, np.uint16)
            buf.ckv[1, :n] = ckv
            buf.kpe[1, :n] = kpe
            resp = self.c.append("ref", 1, buf.ckv[1, :n], buf.kpe[1, :n], **SCALES)
            self.assertEqual(resp.rows_written, n)
            self.assertEqual(len(self.spy.appends), 1)
            rows = self.spy.appends[0].layers[0]
            self.assertEqual((rows.ckv, rows.kpe), (b"", b""))
            self.assertEqual((rows.ckv_ref.region, rows.ckv_ref.offset, rows.ckv_ref.row_stride_bytes),
                             (buf.name, 128 * 1024, 1024))
            self.assertEqual((rows.kpe_ref.region, rows.kpe_ref.offset),
                             (buf.name, 2 * 128 * 1024 + 128 * 128))
        self.client.append("bytes", 1, ckv, kpe, **SCALES)
        self.assert_same_bytes("ref", "bytes", 1)

    def test_interleaved_rows_use_the_row_stride(self):
        # The usual MLA layout: one [N, 576] buffer, ckv = [:, :512], kpe = [:, 512:].
        rng = np.random.default_rng(22)
        n = 33
        ckv, kpe = random_rows(rng, n, "f16")
        with mlakv.ShmRows(self.c, rows=n, dtype="f16") as buf:
            kv = buf.data[:n * 1152].view(np.float16).reshape(n, 576)
            kv[:, :512], kv[:, 512:] = ckv, kpe
            self.c.append("strided", 0, kv[:, :512], kv[:, 512:], **SCALES)
            rows = self.spy.appends[0].layers[0]
            self.assertEqual((rows.ckv_ref.offset, rows.ckv_ref.row_stride_bytes), (0, 1152))
            self.assertEqual((rows.kpe_ref.offset, rows.kpe_ref.row_stride_bytes), (1024, 1152))
            self.assertEqual(self.spy.appends[0].dtype, mlakv.pb.ROW_DTYPE_FLOAT16)
            del kv
        self.client.append("packed", 0, ckv, kpe, **SCALES)
        self.assert_same_bytes("strided", "packed", 0)

    def test_multi_layer_and_large_append_is_one_message(self):
        rng = np.random.default_rng(23)
        n, layers = 3000, [4, 5, 6]  # 3 x 3000 x 1152 bytes = 10 MB: 3 messages as bytes
        with self.c.shm_rows(rows=n, layers=3) as buf:
            for i in range(3):
                buf.ckv[i], buf.kpe[i] = random_rows(rng, n)
            resp = self.c.append("ml-ref", layers, buf.ckv, buf.kpe, **SCALES)
            self.assertEqual(resp.rows_written, 3 * n)
            self.assertEqual(len(self.spy.appends), 1)
            self.assertLess(self.spy.appends[0].ByteSize(), 1024)
            self.assertEqual([l.ckv_ref.offset for l in self.spy.appends[0].layers],
                             [i * n * 1024 for i in range(3)])
            ckv, kpe = buf.ckv.copy(), buf.kpe.copy()
        self.client.append("ml-bytes", layers, ckv, kpe)
        for layer in layers:
            self.assert_same_bytes("ml-ref", "ml-bytes", layer)

    def test_ref_and_bytes_mixed_over_several_messages(self):
        # ckv from the buffer, kpe a copy (bytes): messages sized by the kpe bytes,
        # each reference starting where its message's rows start.
        rng = np.random.default_rng(24)
        n = 100
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, chunk_bytes=10 * 128 + 1024) as c:
            spy = WireSpy(c)
            with c.shm_rows(rows=n) as buf:
                buf.ckv[0], buf.kpe[0] = random_rows(rng, n)
                kpe = buf.kpe[0].copy()
                c.append("mixed", 2, buf.ckv[0], kpe, **SCALES)
                self.assertEqual(len(spy.appends), 10)
                self.assertEqual([m.layers[0].ckv_ref.offset for m in spy.appends],
                                 [i * 10 * 1024 for i in range(10)])
                self.assertTrue(all(len(m.layers[0].kpe) == 10 * 128 for m in spy.appends))
                ckv = buf.ckv[0].copy()
        self.client.append("mixed-bytes", 2, ckv, kpe, **SCALES)
        self.assert_same_bytes("mixed", "mixed-bytes", 2)

    def test_append_batch_by_reference(self):
        rng = np.random.default_rng(25)
        seqs = ["dec-%d" % i for i in range(4)]
        with self.c.shm_rows(rows=len(seqs), layers=2) as buf:
            for l in range(2):
                buf.ckv[l], buf.kpe[l] = random_rows(rng, len(seqs))
            items = [mlakv.SequenceRows(s, {l: (buf.ckv[l, i:i + 1], buf.kpe[l, i:i + 1]) for l in range(2)}, 0)
                     for i, s in enumerate(seqs)]
            resp = self.c.append_batch(items, **SCALES)
            self.assertEqual(resp.rows_written, 8)
            req = self.spy.batches[0]
            self.assertTrue(all(l.ckv_ref.region == buf.name and not l.ckv for s in req.sequences for l in s.layers))
            self.assertEqual(req.sequences[2].layers[1].ckv_ref.offset, (1 * len(seqs) + 2) * 1024)
            expected = {s: {l: (buf.ckv[l, i:i + 1].copy(), buf.kpe[l, i:i + 1].copy()) for l in range(2)}
                        for i, s in enumerate(seqs)}
        for s in seqs:
            for l in range(2):
                self.client.append("ref-" + s, l, *expected[s][l], start=0)
                self.assert_same_bytes(s, "ref-" + s, l)

    def test_decode_step_by_reference(self):
        rng = np.random.default_rng(27)
        seqs = ["cdec-%d" % i for i in range(4)]
        with self.c.shm_rows(rows=len(seqs), layers=3) as buf:
            for l in range(3):
                buf.ckv[l], buf.kpe[l] = random_rows(rng, len(seqs))
            resp = self.c.decode_step(seqs, buf.ckv, buf.kpe, starts=[0] * len(seqs), **SCALES)
            self.assertEqual(resp.rows_written, 12)
            req = self.spy.batches[0]
            # One reference per layer for all sequences, nothing per sequence, no bytes.
            self.assertEqual([len(q.layers) for q in req.sequences], [0] * len(seqs))
            self.assertEqual([(l.layer, l.ckv_ref.region, l.ckv_ref.offset, l.kpe_ref.region, len(l.ckv), len(l.kpe))
                              for l in req.batch_layers],
                             [(l, buf.name, l * len(seqs) * 1024, buf.name, 0, 0) for l in range(3)])
            expected = {s: {l: (buf.ckv[l, i:i + 1].copy(), buf.kpe[l, i:i + 1].copy()) for l in range(3)}
                        for i, s in enumerate(seqs)}
        for s in seqs:
            for l in range(3):
                self.client.append("ref-" + s, l, *expected[s][l], start=0)
                self.assert_same_bytes(s, "ref-" + s, l)

    def test_copies_and_other_memory_go_as_bytes(self):
        rng = np.random.default_rng(26)
        with self.c.shm_rows(rows=16) as buf:
            buf.ckv[0], buf.kpe[0] = random_rows(rng, 16)
            # A copy lives outside the buffer: bytes.
            self.c.append("copy", 0, buf.ckv[0, :8].copy(), buf.kpe[0, :8], start=0, **SCALES)
            # Channels every other element apart (inside the buffer): copied into bytes.
            spread = buf.data[:8 * 2048].view(np.uint16).reshape(8, 1024)[:, ::2]
            self.assertEqual(spread.strides, (2048, 4))
            self.c.append("spread", 0, spread, buf.kpe[0, :8], start=0)
            sent = spread.copy()
            del spread
        first, second = self.spy.appends
        self.assertEqual((len(first.layers[0].ckv), first.layers[0].HasField("ckv_ref")), (8 * 1024, False))
        self.assertTrue(first.layers[0].HasField("kpe_ref"))
        self.assertEqual(len(second.layers[0].ckv), 8 * 1024)
        self.assertEqual(np.frombuffer(second.layers[0].ckv, dtype=np.uint16).reshape(8, 512).tolist(),
                         sent.tolist())
        self.assertTrue(second.layers[0].HasField("kpe_ref"))

    def test_closed_buffer_is_unregistered_and_unlinked(self):
        buf = self.c.shm_rows(rows=4)
        name, shm_name = buf.name, buf.shm_name
        view = buf.ckv[0]  # a view that outlives close(): the mapping stays until it goes
        buf.close()
        buf.close()  # idempotent
        self.assertNotIn(name, [r.name for r in self.c.regions()])
        with self.assertRaises(FileNotFoundError):
            shared_memory.SharedMemory(name=shm_name[1:])
        view[:] = 1  # still mapped locally
        rng = np.random.default_rng(27)
        ckv, kpe = random_rows(rng, 4)
        self.c.append("after-close", 0, ckv, kpe, **SCALES)  # nothing refers to the closed buffer
        self.assertFalse(self.spy.appends[0].layers[0].HasField("ckv_ref"))

    def test_client_close_releases_its_buffers(self):
        c = mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S)
        buf = c.shm_rows(rows=4)
        self.assertIn(buf.name, [r.name for r in self.client.regions()])
        c.close()
        self.assertTrue(buf.closed)
        self.assertNotIn(buf.name, [r.name for r in self.client.regions()])

    def test_bad_shm_rows_arguments(self):
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.shm_rows, rows=0)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.shm_rows, rows=4, dtype="f32")


class RegionRowsTest(RegionTestCase):
    def test_explicit_references_store_the_same_bytes(self):
        rng = np.random.default_rng(28)
        n = 20
        ckv, kpe = random_rows(rng, n)
        shm = shared_memory.SharedMemory(create=True, size=4096 + n * 1024 + n * 256)
        try:
            mem = np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf)
            mem[4096:4096 + n * 1024] = ckv.view(np.uint8).reshape(-1)
            strided = mem[4096 + n * 1024:4096 + n * 1024 + n * 256].reshape(n, 256)
            strided[:, :128] = kpe.view(np.uint8).reshape(n, 128)
            del mem, strided
            self.c.register_shm("explicit", "/" + shm.name)
            ref_ckv = mlakv.RegionRows("explicit", 4096, n)
            ref_kpe = mlakv.RegionRows("explicit", 4096 + n * 1024, n, row_stride_bytes=256)
            e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.append, "x", 0, ref_ckv, ref_kpe)
            self.assertIn("dtype", e.message)
            self.c.append("explicit", 0, ref_ckv, ref_kpe, dtype="bf16", **SCALES)
            # One side data, the other a reference: the dtype comes from the data.
            self.c.append("half", 0, ref_ckv, kpe, **SCALES)
            self.c.append_batch([("batch", {0: (ref_ckv, ref_kpe)}, 0)], dtype="bf16", **SCALES)
            self.client.append("bytes", 0, ckv, kpe, **SCALES)
            for seq in ("explicit", "half", "batch"):
                self.assert_same_bytes(seq, "bytes", 0)
            # Multi-layer: one RegionRows per layer.
            self.c.append("two", [0, 1], [ref_ckv, ref_ckv], [ref_kpe, ref_kpe], dtype="bf16", **SCALES)
            self.assert_same_bytes("two", "bytes", 0)
            self.assert_same_bytes("two", "bytes", 1, layer_b=0)
            self.c.unregister("explicit")
        finally:
            shm.close()
            shm.unlink()

    def test_refusals(self):
        rng = np.random.default_rng(29)
        ckv, kpe = random_rows(rng, 4)
        e = self.assertCode(grpc.StatusCode.NOT_FOUND, self.c.append, "s", 0, mlakv.RegionRows("nope", 0, 4), kpe,
                            **SCALES)
        self.assertIn("nope", e.message)
        shm = shared_memory.SharedMemory(create=True, size=4096)
        try:
            self.c.register_shm("small", "/" + shm.name)
            self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.c.append, "s", 0, mlakv.RegionRows("small", 0, 5),
                            mlakv.RegionRows("small", 0, 5), dtype="bf16", **SCALES)
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.c.append, "s", 0,
                            mlakv.RegionRows("small", 0, 2, row_stride_bytes=1000), kpe[:2], **SCALES)
            client_side = [
                lambda: mlakv.RegionRows("", 0, 4),
                lambda: mlakv.RegionRows("small", -1, 4),
                lambda: self.c.append("s", 0, mlakv.RegionRows("small", 0, 3), kpe),  # 3 rows vs 4
                lambda: self.c.append("s", 0, mlakv.RegionRows("small", 0, 4), kpe, dtype="f16"),  # kpe is bf16
                lambda: self.c.append("s", [0, 1], [mlakv.RegionRows("small", 0, 4)], kpe[None].repeat(2, 0)),
                lambda: self.c.append("s", 0, ckv, kpe, dtype="f16"),
            ]
            for call in client_side:
                e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, call)
                self.assertTrue(e.message.startswith("client: "), e.message)
            self.c.unregister("small")
        finally:
            shm.close()
            shm.unlink()
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "s")


class RegionLockTest(unittest.TestCase):
    """The lock a CUDA region's event record is held under (event mode):
    reentrant on the thread that holds it, exclusive against other threads,
    and released by whichever thread ends the save."""

    def test_reentrant_exclusive_and_released_from_another_thread(self):
        from mlakv.regions import _ThreadShared

        lock = _ThreadShared()
        lock.acquire()
        lock.acquire()  # a second save of the same thread
        got = threading.Event()

        def other():
            lock.acquire()
            got.set()
            lock.release()

        t = threading.Thread(target=other)
        t.start()
        self.assertFalse(got.wait(0.2), "another thread took a held lock")
        released = threading.Thread(target=lambda: (lock.release(), lock.release()))  # wait() on a third thread
        released.start()
        released.join(5)
        self.assertTrue(got.wait(5), "the lock released from another thread was not handed on")
        t.join(5)
        with self.assertRaises(RuntimeError):
            lock.release()  # not held


class WithoutAllowIpcTest(ServerTestCase):
    def test_everything_is_permission_denied(self):
        shm = shared_memory.SharedMemory(create=True, size=4096)
        try:
            rng = np.random.default_rng(30)
            ckv, kpe = random_rows(rng, 1)
            calls = [
                lambda: self.client.register_shm("r", "/" + shm.name),
                lambda: self.client.register_cuda("c", b"\0" * 64, 0, 4096),
                lambda: self.client.unregister("r"),
                lambda: self.client.regions(),
                lambda: self.client.export_pool(),
                lambda: self.client.append("s", 0, mlakv.RegionRows("r", 0, 1), kpe, **SCALES),
            ]
            for call in calls:
                e = self.assertCode(grpc.StatusCode.PERMISSION_DENIED, call)
                self.assertIn("--allow_ipc", e.message)
        finally:
            shm.close()
            shm.unlink()

    def test_shm_rows_refused_leaves_no_object_behind(self):
        import glob
        before = set(glob.glob("/dev/shm/psm_*"))
        self.assertCode(grpc.StatusCode.PERMISSION_DENIED, self.client.shm_rows, rows=4)
        self.assertEqual(set(glob.glob("/dev/shm/psm_*")) - before, set())


if __name__ == "__main__":
    unittest.main(verbosity=2)
