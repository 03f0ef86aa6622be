"""The promises of docs/reliability.md, tried against the real mlakv-server
process the way a hostile or unlucky client would: streams that end every way
but a clean half-close, clients killed mid-message, hostile shared-memory
objects, unbounded inputs, the health port, SIGTERM under load.

After every fault the test checks that nothing was left behind (the sequence
does not exist or is unchanged, no page is held) and that the server still
answers. Run by ctest (label `faults`) with MLAKV_SERVER, MLAKV_PY_GEN and
PYTHONPATH set; /usr/bin/python3 (python3-grpcio, python3-numpy).
"""

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from multiprocessing import shared_memory

import grpc

import mlakv  # noqa: F401  (puts the generated stubs on the path)
from mlakv.v1 import kv_cache_pb2 as pb
from mlakv.v1 import kv_cache_pb2_grpc as pbg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python", "tests"))
from server_process import ServerProcess  # noqa: E402

ROW_BYTES = (512 + 64) * 2
BF16_ONE = b"\x80\x3f"  # 1.0 in bf16, little-endian
APPEND = "/mlakv.v1.KvCache/Append"


def rows_message(sequence, start, n, layers=(0,), pool="", scales=True, **fields):
    m = pb.AppendRequest(pool=pool, sequence=sequence, start=start, row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16, **fields)
    for layer in layers:
        m.layers.add(layer=layer, ckv=BF16_ONE * 512 * n, kpe=BF16_ONE * 64 * n,
                     ckv_scale=1.0 if scales else 0.0, kpe_scale=1.0 if scales else 0.0)
    return m


def config_file(text):
    f = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
    f.write(text)
    f.close()
    return f.name


class FaultCase(unittest.TestCase):
    """A server per test class; `extra` are its flags, `config` its ServerConfig text."""

    extra = ()
    config = "pools { name: 'default' num_layers: 2 page_size: 4 num_pages: 256 }"

    @classmethod
    def setUpClass(cls):
        cls.config_path = config_file(cls.config)
        cls.server = ServerProcess("--config", cls.config_path, *cls.extra).start()
        cls.channel = grpc.insecure_channel(cls.server.target, options=[("grpc.max_send_message_length", -1),
                                                                        ("grpc.max_receive_message_length", -1)])
        cls.stub = pbg.KvCacheStub(cls.channel)
        cls.raw_append = cls.channel.stream_unary(APPEND, request_serializer=None,
                                                  response_deserializer=pb.AppendResponse.FromString)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()
        os.unlink(cls.config_path)

    def pool(self):
        return self.stub.GetPool(pb.GetPoolRequest(), timeout=10)

    def assert_gone(self, sequence):
        with self.assertRaises(grpc.RpcError) as err:
            self.stub.GetSequence(pb.GetSequenceRequest(sequence=sequence), timeout=10)
        self.assertEqual(err.exception.code(), grpc.StatusCode.NOT_FOUND, err.exception.details())

    def assert_clean(self, sequence=None):
        """No page held, the allocator's books balance, and the server answers."""
        deadline = time.monotonic() + 5
        while True:
            p = self.pool()
            if p.pages_used == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)  # a rollback may still be on the worker
        self.assertEqual(p.pages_used, 0)
        self.assertEqual(p.pages_free + p.pages_used, p.pages_total)
        if sequence is not None:
            self.assert_gone(sequence)

    def append_raw(self, messages, timeout=20):
        try:
            self.raw_append(iter(messages), timeout=timeout)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details() or ""


class StreamEnds(FaultCase):
    """An Append stream that ends any way but a clean half-close commits nothing."""

    config = ("pools { name: 'default' num_layers: 2 page_size: 4 num_pages: 256 } "
              "max_message_bytes: 1048576 append_idle_timeout_seconds: 1")

    def test_clean_half_close_commits(self):
        code, _ = self.append_raw([rows_message("ok", 0, 4).SerializeToString(),
                                   rows_message("", 4, 4).SerializeToString()])
        self.assertEqual(code, grpc.StatusCode.OK)
        seq = self.stub.GetSequence(pb.GetSequenceRequest(sequence="ok"), timeout=10)
        self.assertEqual(seq.layer_lengths[0], 8)
        self.stub.FreeSequence(pb.FreeSequenceRequest(sequence="ok"), timeout=10)
        self.assert_clean()

    def test_truncated_second_message(self):
        for cut in (1, 7, 100, 1000):
            second = rows_message("", 4, 4).SerializeToString()[:-cut]
            code, details = self.append_raw([rows_message("t", 0, 4).SerializeToString(), second])
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
            self.assertIn("message 2", details)
            self.assert_clean("t")

    def test_invalid_utf8_in_a_later_message(self):
        second = pb.AppendRequest(sequence="u").SerializeToString().replace(b"u", b"\xff", 1)
        code, details = self.append_raw([rows_message("u", 0, 4).SerializeToString(), second])
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assert_clean("u")

    def test_garbage_bytes_as_the_first_message(self):
        code, details = self.append_raw([b"\xff\xff\xff\xff\x0f garbage"])
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assert_clean()

    def test_message_over_the_size_limit(self):
        big = rows_message("", 4, 1000).SerializeToString()  # 1.15 MB > 1 MiB
        for _ in range(10):
            code, details = self.append_raw([rows_message("big", 0, 4).SerializeToString(), big])
            self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            self.assertIn("max_message_bytes", details)
            self.assert_clean("big")

    def test_client_cancel_mid_stream(self):
        gate = threading.Event()

        def messages():
            yield rows_message("c", 0, 4).SerializeToString()
            gate.wait(10)

        fut = self.raw_append.future(messages(), timeout=20)
        time.sleep(0.3)  # message 1 is staged
        fut.cancel()
        gate.set()
        self.assertTrue(fut.cancelled())
        self.assert_clean("c")

    def test_deadline_passes_mid_stream(self):
        def messages():
            yield rows_message("d", 0, 4).SerializeToString()
            time.sleep(0.8)
            yield rows_message("", 4, 4).SerializeToString()

        code, _ = self.append_raw(messages(), timeout=0.4)
        self.assertEqual(code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assert_clean("d")

    def test_idle_stream_is_ended_and_rolled_back(self):
        def messages():
            m = rows_message("idle", 0, 4)
            m.reserve_tokens = 200  # 50 pages held while the stream is open
            yield m.SerializeToString()
            time.sleep(4)  # the server's append_idle_timeout_seconds is 1

        started = time.monotonic()
        code, details = self.append_raw(messages(), timeout=30)
        self.assertEqual(code, grpc.StatusCode.DEADLINE_EXCEEDED, details)
        self.assertIn("append_idle_timeout_seconds", details)
        self.assertLess(time.monotonic() - started, 3.5)
        self.assert_clean("idle")

    def test_client_killed_mid_message(self):
        for i in range(12):
            proc = subprocess.Popen([sys.executable, os.path.join(HERE, "killed_producer.py"), self.server.target,
                                     "k%d" % i, "big" if i % 2 == 0 else "stall"], stdout=subprocess.PIPE)
            self.assertEqual(proc.stdout.readline().strip(), b"sent first message")
            time.sleep(0.05 + 0.02 * i)
            proc.kill()
            proc.wait()
            self.assert_clean("k%d" % i)

    def test_raw_tcp_client_that_sends_half_a_request_and_closes(self):
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", self.server.port))
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04")  # a preface and half a SETTINGS frame
            s.close()
        self.assert_clean()


class Shapes(FaultCase):
    """Malformed shapes before capacity; bounded quotes of what came."""

    def test_huge_row_count_is_invalid_argument(self):
        m = pb.AppendRequest(sequence="s", row_count=0xFFFFFFFF, dtype=pb.ROW_DTYPE_BFLOAT16)
        m.layers.add(layer=0)
        code, details = self.append_raw([m.SerializeToString()])
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assert_clean("s")

    def test_long_ids_are_refused_with_a_bounded_message_and_log(self):
        log_before = len(self.server.log_text())
        for size in (65536, 8 << 20):
            code, details = self.append_raw([rows_message("x" * size, 0, 1).SerializeToString()])
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertLess(len(details), 1024)
            with self.assertRaises(grpc.RpcError) as err:
                self.stub.GetSequence(pb.GetSequenceRequest(sequence="y" * size), timeout=10)
            self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertLess(len(err.exception.details()), 1024)
        self.assertLess(len(self.server.log_text()) - log_before, 16 * 1024)
        self.assert_clean()

    def test_a_newline_in_an_id_cannot_forge_a_log_line(self):
        forged = "a\n2026-12-01T00:00:00.000Z info listening on 6.6.6.6:1"
        with self.assertRaises(grpc.RpcError):
            self.stub.GetSequence(pb.GetSequenceRequest(sequence=forged), timeout=10)
        self.assertNotIn("listening on 6.6.6.6", "\n".join(
            line for line in self.server.log_text().splitlines() if line.startswith("2026-12-01T00:00:00")))
        self.assertIn("a\\n2026-12-01", self.server.log_text())

    def test_zero_row_appends_leave_no_sequences(self):
        for i in range(2000):
            self.stub.AppendBatch(pb.AppendBatchRequest(sequences=[pb.SequenceRows(sequence="z%d" % i)]), timeout=10)
        self.assertEqual(self.pool().sequences, 0)

    def test_read_naming_a_layer_200k_times_is_refused_at_once(self):
        self.stub.AppendBatch(pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_BFLOAT16, sequences=[
            pb.SequenceRows(sequence="r", row_count=1, layers=[pb.LayerRows(
                layer=0, ckv=BF16_ONE * 512, kpe=BF16_ONE * 64, ckv_scale=1.0, kpe_scale=1.0)])]), timeout=10)
        started = time.monotonic()
        with self.assertRaises(grpc.RpcError) as err:
            list(self.stub.ReadSequence(pb.ReadSequenceRequest(sequence="r", layers=[0] * 200000), timeout=10))
        self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertLess(time.monotonic() - started, 2)
        self.stub.FreeSequence(pb.FreeSequenceRequest(sequence="r"), timeout=10)
        self.assert_clean()

    def test_retry_with_expect_length_cannot_duplicate(self):
        m = rows_message("e", 0, 4, expect_length=0)
        self.assertEqual(self.append_raw([m.SerializeToString()])[0], grpc.StatusCode.OK)
        code, details = self.append_raw([m.SerializeToString()])
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION, details)
        seq = self.stub.GetSequence(pb.GetSequenceRequest(sequence="e"), timeout=10)
        self.assertEqual(list(seq.layer_lengths), [4, 0])
        self.stub.FreeSequence(pb.FreeSequenceRequest(sequence="e"), timeout=10)


class HostileRegions(FaultCase):
    """Shared-memory objects that cannot hurt the server (--allow_ipc)."""

    extra = ("--allow_ipc",)
    config = ("pools { name: 'default' num_layers: 2 page_size: 64 num_pages: 2048 } "
              "max_regions: 16 max_message_bytes: 67108864")

    def setUp(self):
        self.cleanup = []

    def tearDown(self):
        for path in self.cleanup:
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
            except OSError:
                pass

    def register(self, name, shm_name, timeout=10):
        return self.stub.RegisterShmRegion(pb.RegisterShmRegionRequest(name=name, shm_name=shm_name), timeout=timeout)

    def expect_refused(self, shm_name, code):
        started = time.monotonic()
        with self.assertRaises(grpc.RpcError) as err:
            self.register("bad", shm_name)
        self.assertEqual(err.exception.code(), code, err.exception.details())
        self.assertLess(time.monotonic() - started, 2)
        self.assertNotIn("\n", err.exception.details())

    def test_a_fifo_neither_blocks_nor_registers(self):
        path = "/dev/shm/mlakv-fault-fifo-%d" % os.getpid()
        os.mkfifo(path)
        self.cleanup.append(path)
        threads = [threading.Thread(target=self.expect_refused, args=(path[8:], grpc.StatusCode.FAILED_PRECONDITION))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        self.assertEqual(self.pool().pages_used, 0)  # the server still answers

    def test_directories_dots_links_and_nul_are_refused(self):
        d = "/dev/shm/mlakv-fault-dir-%d" % os.getpid()
        os.mkdir(d)
        self.cleanup.append(d)
        self.expect_refused(d[8:], grpc.StatusCode.FAILED_PRECONDITION)
        self.expect_refused("/..", grpc.StatusCode.INVALID_ARGUMENT)
        self.expect_refused("/.", grpc.StatusCode.INVALID_ARGUMENT)
        self.expect_refused("/a\x00b", grpc.StatusCode.INVALID_ARGUMENT)
        self.expect_refused("/../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT)
        target = shared_memory.SharedMemory(create=True, size=4096)
        try:
            link = "/dev/shm/mlakv-fault-link-%d" % os.getpid()
            os.symlink("/dev/shm/" + target.name, link)
            self.cleanup.append(link)
            self.expect_refused(link[8:], grpc.StatusCode.INVALID_ARGUMENT)
        finally:
            target.close()
            target.unlink()

    def test_region_count_is_bounded(self):
        shm = shared_memory.SharedMemory(create=True, size=4096)
        try:
            fds_before = len(os.listdir("/proc/%d/fd" % self.server.proc.pid))
            registered = 0
            refused = None
            for i in range(200):
                try:
                    self.register("r%d" % i, "/" + shm.name)
                    registered += 1
                except grpc.RpcError as e:
                    refused = e
                    break
            self.assertEqual(registered, 16)
            self.assertEqual(refused.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details())
            self.assertIn("max_regions", refused.details())
            self.assertLessEqual(len(os.listdir("/proc/%d/fd" % self.server.proc.pid)) - fds_before, 16)
            for i in range(registered):
                self.stub.UnregisterRegion(pb.UnregisterRegionRequest(name="r%d" % i), timeout=10)
            self.register("again", "/" + shm.name)  # room again once released
            self.stub.UnregisterRegion(pb.UnregisterRegionRequest(name="again"), timeout=10)
        finally:
            shm.close()
            shm.unlink()

    def test_a_producer_shrinking_its_object_during_appends_never_crashes_the_server(self):
        rows = 4096
        size = rows * ROW_BYTES
        shm = shared_memory.SharedMemory(create=True, size=size)
        stop = threading.Event()
        shrinks = [0]

        def shrinker():
            fd = os.open("/dev/shm/" + shm.name, os.O_RDWR)
            try:
                while not stop.is_set():
                    os.ftruncate(fd, 4096)
                    shrinks[0] += 1
                    time.sleep(0.002)
                    os.ftruncate(fd, size)
                    time.sleep(0.003)
            finally:
                os.ftruncate(fd, size)
                os.close(fd)

        def register():
            # The object may be shrunk right now (OUT_OF_RANGE): try again.
            for _ in range(1000):
                try:
                    return self.stub.RegisterShmRegion(pb.RegisterShmRegionRequest(
                        name="shrinking", shm_name="/" + shm.name, byte_size=size), timeout=10)
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.OUT_OF_RANGE, e.details())
                    time.sleep(0.001)
            self.fail("could not register the region")

        def unregister():
            self.stub.UnregisterRegion(pb.UnregisterRegionRequest(name="shrinking"), timeout=10)

        t = threading.Thread(target=shrinker)
        outcomes = {}
        try:
            register()
            t.start()
            for i in range(80):
                m = pb.AppendRequest(sequence="s%d" % i, row_count=rows, dtype=pb.ROW_DTYPE_BFLOAT16)
                if i % 2 == 0:  # interleaved rows: gathered on the worker
                    ckv = pb.RegionRef(region="shrinking", offset=0, row_stride_bytes=ROW_BYTES)
                    kpe = pb.RegionRef(region="shrinking", offset=1024, row_stride_bytes=ROW_BYTES)
                else:  # packed rows: read in place by the quantizer's threads
                    ckv = pb.RegionRef(region="shrinking", offset=0)
                    kpe = pb.RegionRef(region="shrinking", offset=rows * 1024)
                m.layers.add(layer=0, ckv_scale=1.0, kpe_scale=1.0, ckv_ref=ckv, kpe_ref=kpe)
                code, details = self.append_raw([m.SerializeToString()])
                kind = code.name if code != grpc.StatusCode.FAILED_PRECONDITION else (
                    "poisoned" if "register it again" in details or "shrank while" in details else "shrunk before")
                outcomes[kind] = outcomes.get(kind, 0) + 1
                self.assertIn(code, (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), details)
                if code == grpc.StatusCode.OK:
                    self.stub.FreeSequence(pb.FreeSequenceRequest(sequence="s%d" % i), timeout=10)
                else:
                    self.assert_gone("s%d" % i)
                if kind == "poisoned":  # as the message says: register it again
                    unregister()
                    register()
            stop.set()
            t.join()
            self.assertIsNone(self.server.proc.poll(), "the server died")
            self.assertGreater(shrinks[0], 10)
            # With the producer well behaved again, the region (registered
            # afresh) serves appends as before.
            unregister()
            register()
            m = pb.AppendRequest(sequence="after", row_count=rows, dtype=pb.ROW_DTYPE_BFLOAT16)
            m.layers.add(layer=0, ckv_scale=1.0, kpe_scale=1.0, ckv_ref=pb.RegionRef(region="shrinking", offset=0),
                         kpe_ref=pb.RegionRef(region="shrinking", offset=rows * 1024))
            code, details = self.append_raw([m.SerializeToString()])
            self.assertEqual(code, grpc.StatusCode.OK, details)
            self.stub.FreeSequence(pb.FreeSequenceRequest(sequence="after"), timeout=10)
            self.assert_clean()
            print("shrinking producer: %d shrinks, outcomes %s" % (shrinks[0], outcomes))
        finally:
            stop.set()
            if t.is_alive():
                t.join()
            try:
                unregister()
            except grpc.RpcError:
                pass
            shm.close()
            shm.unlink()


class HealthPort(FaultCase):
    """The --health_listen port serves grpc.health.v1.Health and nothing else."""

    extra = ("--health_listen", "127.0.0.1:0")

    def test_only_health_on_the_probe_port(self):
        port = int(re.search(r"health probe port (\d+)", self.server.log_text()).group(1))
        with grpc.insecure_channel("127.0.0.1:%d" % port) as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                   response_deserializer=None)
            self.assertEqual(check(b"", timeout=10), b"\x08\x01")  # status: SERVING
            reflection = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                          request_serializer=None, response_deserializer=None)
            with self.assertRaises(grpc.RpcError) as err:
                list(reflection(iter([b"\x3a\x00"]), timeout=10))  # list_services
            self.assertEqual(err.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            pools = ch.unary_unary("/mlakv.v1.KvCache/ListPools", request_serializer=None, response_deserializer=None)
            with self.assertRaises(grpc.RpcError) as err:
                pools(b"", timeout=10)
            self.assertEqual(err.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
        # ... while the main port still serves reflection.
        reflection = self.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                                request_serializer=None, response_deserializer=None)
        self.assertTrue(list(reflection(iter([b"\x3a\x00"]), timeout=10)))


class SigtermUnderLoad(unittest.TestCase):
    """SIGTERM while clients append: the server drains and exits 0; every call
    ends OK, UNAVAILABLE (refused while draining) or CANCELLED (cut by the grace)."""

    def test_drain_under_load(self):
        # Every call appends a new 8-row sequence (2 pages) and none is freed:
        # 65,536 pages hold 32,768 of them, 16x what four clients append in
        # the second before the signal on a fast machine (2,048 filled 4,096
        # pages there and later calls met RESOURCE_EXHAUSTED).
        path = config_file("pools { name: 'default' num_layers: 2 page_size: 4 num_pages: 65536 }")
        server = ServerProcess("--config", path, "--drain_grace_s", "5").start()
        try:
            stop = threading.Event()
            codes = {}
            lock = threading.Lock()

            def client(k):
                with grpc.insecure_channel(server.target) as ch:
                    raw = ch.stream_unary(APPEND, request_serializer=None,
                                          response_deserializer=pb.AppendResponse.FromString)
                    i = 0
                    while not stop.is_set():
                        try:
                            raw(iter([rows_message("c%d-%d" % (k, i), 0, 8).SerializeToString()]), timeout=10)
                            code = grpc.StatusCode.OK
                        except grpc.RpcError as e:
                            code = e.code()
                        with lock:
                            codes[code] = codes.get(code, 0) + 1
                        i += 1
                        if code not in (grpc.StatusCode.OK,):
                            time.sleep(0.01)

            threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            rc = server.proc.wait(15)
            elapsed = time.monotonic() - started
            time.sleep(0.3)
            stop.set()
            for t in threads:
                t.join(20)
            self.assertEqual(rc, 0, server.log_text()[-3000:])
            self.assertLess(elapsed, 8)
            allowed = {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
            self.assertTrue(set(codes) <= allowed, codes)
            self.assertGreater(codes.get(grpc.StatusCode.OK, 0), 10, codes)
            print("SIGTERM under load: exit %d after %.2f s, calls %s" % (rc, elapsed, codes))
        finally:
            server.stop()
            os.unlink(path)

    def test_drain_after_a_stream_that_never_sent_a_message(self):
        # A stream opened and never written to, ended by the idle timeout: it
        # once stayed counted in flight for ever, and SIGTERM's drain hung.
        path = config_file("pools { name: 'default' num_layers: 2 page_size: 4 num_pages: 64 } "
                           "append_idle_timeout_seconds: 1")
        server = ServerProcess("--config", path, "--drain_grace_s", "2").start()
        try:
            release = threading.Event()
            ended = {}

            def silent():
                release.wait(30)
                return
                yield  # a generator that sends nothing until released

            def stream():
                with grpc.insecure_channel(server.target) as ch:
                    raw = ch.stream_unary(APPEND, request_serializer=None,
                                          response_deserializer=pb.AppendResponse.FromString)
                    started = time.monotonic()
                    try:
                        raw(silent(), timeout=30)
                        ended["code"] = grpc.StatusCode.OK
                    except grpc.RpcError as e:
                        ended["code"], ended["details"] = e.code(), e.details()
                    ended["seconds"] = time.monotonic() - started

            t = threading.Thread(target=stream)
            t.start()
            t.join(6)
            self.assertFalse(t.is_alive(), "the silent stream was not ended by the idle timeout")
            self.assertEqual(ended["code"], grpc.StatusCode.DEADLINE_EXCEEDED, ended)
            self.assertIn("after message 0", ended["details"])
            self.assertLess(ended["seconds"], 4, ended)
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                rc = server.proc.wait(15)
            finally:
                release.set()
            self.assertEqual(rc, 0, server.log_text()[-3000:])
            self.assertLess(time.monotonic() - started, 4, "the drain waited for the ended stream")
        finally:
            release.set()
            server.stop()
            os.unlink(path)


if __name__ == "__main__":
    unittest.main(verbosity=2)
