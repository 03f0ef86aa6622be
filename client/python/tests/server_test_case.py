"""Test cases and helpers shared by the Python client tests that run against a
real mlakv-server process (test_client.py, test_regions.py,
cuda_region_test.py). Not a test module itself (no test_ prefix).

    class MyTest(ServerTestCase):          # one server per class, self.client
        server_args = ("--allow_ipc",)
"""

import faulthandler
import unittest

import numpy as np

import mlakv
from server_process import ServerProcess

# ctest kills the suite at 300 s; a run still going at 270 s prints every
# thread's Python stack first (stderr), so that a hang says where it waited.
faulthandler.dump_traceback_later(270, exit=False)

CALL_TIMEOUT_S = 60.0


def cuda_missing():
    """Why the CUDA tests cannot run here (no torch, no CUDA device), or None."""
    try:
        import torch
    except ImportError as err:
        return "torch is not importable (%s)" % err
    if not torch.cuda.is_available():
        return "torch %s sees no CUDA device" % torch.__version__
    return None


def random_rows(rng, n, dtype="bf16", amax=4.0):
    """n random rows: (ckv [n,512], kpe [n,64]) as float16 or bf16 bit patterns (uint16)."""
    ckv = rng.uniform(-amax, amax, size=(n, 512)).astype(np.float32)
    kpe = rng.uniform(-amax, amax, size=(n, 64)).astype(np.float32)
    if dtype == "f16":
        return ckv.astype(np.float16), kpe.astype(np.float16)
    return to_bf16(ckv), to_bf16(kpe)


def to_bf16(x):
    """float32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


class ServerTestCase(unittest.TestCase):
    """One fresh server per test class (`server_args` on `server_device`);
    self.client talks to it. The server must exit with status 0 on SIGTERM."""

    server_args = ()
    server_device = "cpu"

    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(*cls.server_args, device=cls.server_device)
        cls.server.start()
        cls.client = mlakv.Client(cls.server.target, timeout=CALL_TIMEOUT_S)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        if cls.server.returncode != 0:
            raise AssertionError("mlakv-server exited with %s on SIGTERM:\n%s"
                                 % (cls.server.returncode, cls.server.log_text()[-4000:]))

    def assertCode(self, code, fn, *args, **kwargs):
        with self.assertRaises(mlakv.Error) as ctx:
            fn(*args, **kwargs)
        self.assertEqual(ctx.exception.code, code, str(ctx.exception))
        self.assertTrue(ctx.exception.message, "empty error message")
        return ctx.exception


class RegionServerTestCase(ServerTestCase):
    """A server with --allow_ipc. Each test gets its own client, self.c (the
    one that registers regions); after it, self.c is closed, every sequence is
    freed and a region still registered is a failure (and unregistered)."""

    server_args = ("--allow_ipc",)

    def setUp(self):
        self.c = mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S)

    def tearDown(self):
        self.c.close()
        for s in self.client.sequences():
            self.client.free(s.id)
        left = [r.name for r in self.client.regions()]
        for name in left:  # so that one failure does not fail the tests after it
            self.client.unregister(name)
        self.assertEqual(left, [], "the test (or Client.close) left regions registered")

    def assert_same_bytes(self, seq_a, seq_b, layer, layer_b=None):
        """Sequence seq_a's `layer` stores the bytes of seq_b's `layer_b` (default: the same layer)."""
        layer_b = layer if layer_b is None else layer_b
        a, b = self.client.export(seq_a, layer), self.client.export(seq_b, layer_b)
        self.assertGreater(len(a["kpe"]), 0)
        for k in ("ckv_packed", "ckv_sf", "kpe"):
            np.testing.assert_array_equal(a[k], b[k], err_msg="%s layer %d vs %s layer %d: %s"
                                          % (seq_a, layer, seq_b, layer_b, k))


class WireSpy:
    """Records the Append / AppendBatch requests a client sends."""

    def __init__(self, client):
        self.appends, self.batches = [], []
        real_append, real_batch = client._stub.Append, client._stub.AppendBatch

        def append(requests, **kwargs):
            msgs = list(requests)
            self.appends.extend(msgs)
            return real_append(iter(msgs), **kwargs)

        def batch(request, **kwargs):
            self.batches.append(request)
            return real_batch(request, **kwargs)

        client._stub.Append, client._stub.AppendBatch = append, batch
