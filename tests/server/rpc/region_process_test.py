"""Host shared-memory regions against the real mlakv-server process (loopback).

A producer (this process) writes bf16 rows into a POSIX shared-memory object,
registers it with `mlakv-server --allow_ipc --device cpu`, appends from it, and
the stored bytes (ReadSequence RAW) equal those of the same rows sent as bytes.
The mlakv_ipc_regions gauge follows registrations. Also: the same server without --allow_ipc refuses with PERMISSION_DENIED, and
an unregistered region is NOT_FOUND while the server keeps serving.

Environment (set by ctest): MLAKV_SERVER, MLAKV_PY_GEN, PYTHONPATH=client/python.
"""

import os
import random
import re
import struct
import sys
import unittest
import urllib.request
from multiprocessing import shared_memory

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "client", "python", "tests"))
import mlakv  # noqa: E402
from mlakv.v1 import kv_cache_pb2 as pb  # noqa: E402
from mlakv.v1 import kv_cache_pb2_grpc as pb_grpc  # noqa: E402
from server_process import ServerProcess  # noqa: E402

TIMEOUT_S = 30
CKV_ROW = 512 * 2
KPE_ROW = 64 * 2


def bf16_rows(n, channels, seed):
    rng = random.Random(seed)
    out = bytearray()
    for _ in range(n * channels):
        f = rng.gauss(0.0, 1.0) * 2.0 ** rng.randint(-4, 4)
        out += struct.pack("<I", struct.unpack("<I", struct.pack("<f", f))[0])[2:4]
    return bytes(out)


def read_raw(stub, sequence, layer, count):
    req = pb.ReadSequenceRequest(sequence=sequence, layers=[layer], start=0, count=count,
                                 format=pb.READ_FORMAT_RAW)
    ckv, sf, kpe = b"", b"", b""
    for chunk in stub.ReadSequence(req, timeout=TIMEOUT_S):
        ckv += chunk.ckv_packed
        sf += chunk.ckv_sf
        kpe += chunk.kpe
    return ckv, sf, kpe


def ipc_regions_gauge(metrics_target):
    with urllib.request.urlopen("http://%s/metrics" % metrics_target, timeout=TIMEOUT_S) as r:
        text = r.read().decode()
    m = re.search(r"^mlakv_ipc_regions (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def layer_rows(layer, **kw):
    return pb.LayerRows(layer=layer, ckv_scale=0.0625, kpe_scale=0.03125, **kw)


class RegionProcessTest(unittest.TestCase):
    def test_shm_append_matches_bytes_append(self):
        n = 50
        ckv = bf16_rows(n, 512, 1)
        kpe = bf16_rows(n, 64, 2)
        shm = shared_memory.SharedMemory(create=True, size=len(ckv) + len(kpe) + 4096)
        try:
            shm.buf[4096:4096 + len(ckv)] = ckv
            shm.buf[4096 + len(ckv):4096 + len(ckv) + len(kpe)] = kpe
            with ServerProcess("--allow_ipc", "--metrics_listen", "127.0.0.1:0") as server:
                metrics = "127.0.0.1:%d" % server.metrics_port()
                with grpc.insecure_channel(server.target) as channel:
                    stub = pb_grpc.KvCacheStub(channel)
                    region = stub.RegisterShmRegion(
                        pb.RegisterShmRegionRequest(name="prefill-0", shm_name="/" + shm.name, offset=4096),
                        timeout=TIMEOUT_S)
                    self.assertEqual(region.byte_size, len(ckv) + len(kpe))
                    self.assertEqual(region.kind, pb.REGION_KIND_SHM)
                    self.assertEqual(ipc_regions_gauge(metrics), 1)
                    resp = stub.Append(iter([pb.AppendRequest(
                        sequence="ipc", row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16,
                        layers=[layer_rows(0, ckv_ref=pb.RegionRef(region="prefill-0", offset=0),
                                           kpe_ref=pb.RegionRef(region="prefill-0", offset=len(ckv)))])]),
                        timeout=TIMEOUT_S)
                    self.assertEqual(resp.rows_written, n)
                    stub.Append(iter([pb.AppendRequest(sequence="bytes", row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16,
                                                       layers=[layer_rows(0, ckv=ckv, kpe=kpe)])]),
                                timeout=TIMEOUT_S)
                    self.assertEqual(read_raw(stub, "ipc", 0, n), read_raw(stub, "bytes", 0, n))
                    listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=TIMEOUT_S).regions
                    self.assertEqual([r.name for r in listed], ["prefill-0"])
                    stub.UnregisterRegion(pb.UnregisterRegionRequest(name="prefill-0"), timeout=TIMEOUT_S)
                    self.assertEqual(ipc_regions_gauge(metrics), 0)
                    with self.assertRaises(grpc.RpcError) as err:
                        stub.Append(iter([pb.AppendRequest(
                            sequence="late", row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16,
                            layers=[layer_rows(0, ckv_ref=pb.RegionRef(region="prefill-0"),
                                               kpe_ref=pb.RegionRef(region="prefill-0", offset=len(ckv)))])]),
                            timeout=TIMEOUT_S)
                    self.assertEqual(err.exception.code(), grpc.StatusCode.NOT_FOUND, err.exception.details())
                    # Still serving.
                    self.assertEqual(stub.GetSequence(pb.GetSequenceRequest(sequence="ipc"),
                                                      timeout=TIMEOUT_S).layer_lengths[0], n)
        finally:
            shm.close()
            shm.unlink()

    def test_without_allow_ipc_everything_is_permission_denied(self):
        shm = shared_memory.SharedMemory(create=True, size=1 << 16)
        try:
            with ServerProcess() as server:
                with grpc.insecure_channel(server.target) as channel:
                    stub = pb_grpc.KvCacheStub(channel)
                    calls = [
                        lambda: stub.RegisterShmRegion(pb.RegisterShmRegionRequest(name="r", shm_name="/" + shm.name),
                                                       timeout=TIMEOUT_S),
                        lambda: stub.RegisterCudaRegion(pb.RegisterCudaRegionRequest(name="c", raw_handle=bytes(64),
                                                                                     byte_size=1024),
                                                        timeout=TIMEOUT_S),
                        lambda: stub.UnregisterRegion(pb.UnregisterRegionRequest(name="r"), timeout=TIMEOUT_S),
                        lambda: stub.ListRegions(pb.ListRegionsRequest(), timeout=TIMEOUT_S),
                    ]
                    for call in calls:
                        with self.assertRaises(grpc.RpcError) as err:
                            call()
                        self.assertEqual(err.exception.code(), grpc.StatusCode.PERMISSION_DENIED,
                                         err.exception.details())
                        self.assertIn("--allow_ipc", err.exception.details())
        finally:
            shm.close()
            shm.unlink()


if __name__ == "__main__":
    unittest.main(verbosity=2)
