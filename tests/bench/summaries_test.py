"""bench/aims_summary.py and bench/phases_summary.py on the programs' own
output (lines copied from runs on an H100 host, 2026-12-07): every aim judged
from the right line, a part that printed nothing judged "not measured" --
never met -- and the server's phases reduced to their medians."""

import contextlib
import importlib.util
import io
import os
import tempfile
import unittest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


aims = load("aims_summary")
phases = load("phases_summary")

FLOOR = """\
rpc_floor_bench: each server alone in the process, in turn (2 rounds x 2000 calls), 16 cores, mlakv-server on 8 threads
  minimal sync server, Health/Check                    p50   137.6 us  p90   250.0  p99  1873.6   p50 / sync floor 1.00x
  minimal sync server, GetPool's work                  p50   163.4 us  p90   290.9  p99  1727.1   p50 / sync floor 1.19x
  mlakv-server, GetPool                                p50   154.1 us  p90   169.1  p99   315.0   p50 / sync floor 1.12x
GetPool's work without gRPC (p50 of 20000, 286-byte response): snapshot 0.40 us, to proto 1.00 us
rpc_floor_bench: 2 x 2000 unary calls per variant over loopback TCP, 16 cores
  minimal sync server, Health/Check                    p50    50.0 us  p90   375.2  p99  2290.4   p50 / sync floor 1.00x
  mlakv-server, GetPool                                p50   500.0 us  p90   412.5  p99  3006.6   p50 / sync floor 10.0x
"""

IPC = """\
== round 1: mlakv-server
decode step by reference: 256 sequences x 1 token x 61 layers (15616 rows), 400 steps
  AppendBatch compact end to end: p50 635.1 us, p90 904.6 us, p99 3322.0 us (min 399.3); GetPool p50 199.3 us
    the same, view COMPACT (steps interleaved): p50 568.8 us, p90 967.1 us, p99 3215.2 us (min 348.5)
    the same, view PACKED (steps interleaved): p50 294.2 us, p90 973.8 us, p99 999.0 us (min 316.1)
  kernel, all layers in one launch: 18.4 us; one launch per layer: 314.9 us; copy of the step's bytes: 15.5 us (one launch / copy = 1.19x; each timed from an L2 cleared by a 100 MB write)
ipc append of 262144 bf16 rows (one layer), medians of 20: kernel alone 142.3 us; GetPool (RPC floor) 176.9 us
  Append                     end to end 652.1 us (min 542.0): kernel + 509.8 us
  AppendBatch                end to end 291.6 us (min 378.4): kernel + 149.3 us
  AppendBatch, view LENGTHS  end to end 467.6 us (min 384.3): kernel + 325.3 us
ipc append of 1 bf16 rows (one layer), medians of 200: kernel alone 8.0 us; GetPool (RPC floor) 100.0 us
  Append                     end to end 345.0 us (min 181.2): kernel + 337.0 us
  AppendBatch, view LENGTHS  end to end 130.0 us (min 92.0): kernel + 122.0 us
== round 2: mlakv-server
decode step by reference: 256 sequences x 1 token x 61 layers (15616 rows), 400 steps
    the same, view PACKED (steps interleaved): p50 432.0 us, p90 573.2 us, p99 2199.2 us (min 319.7)
  kernel, all layers in one launch: 18.4 us; one launch per layer: 314.9 us; copy of the step's bytes: 13.9 us (one launch / copy = 1.32x; each timed)
ipc append of 262144 bf16 rows (one layer), medians of 20: kernel alone 140.2 us; GetPool (RPC floor) 131.5 us
  AppendBatch, view LENGTHS  end to end 280.2 us (min 343.3): kernel + 140.0 us
ipc append of 1 bf16 rows (one layer), medians of 200: kernel alone 8.0 us; GetPool (RPC floor) 100.0 us
  AppendBatch, view LENGTHS  end to end 131.0 us (min 87.9): kernel + 123.0 us
"""

KERNEL = """\
== run 1
device: NVIDIA H100 80GB HBM3, 132 SMs, L2 50 MB; median of 200 launches each (CUDA events)
case                          rows  kernel_us      TB/s    copy_us copy_TB/s   ratio   %copy
prefill_4x4096               16384      16.50     1.500      14.52     1.700   0.880    88.0%  rpw=4 wpb=4 bps=8
prefill_8x4096               32768      30.10     1.600      27.70     1.700   0.920    92.0%  rpw=8 wpb=8 bps=4
prefill_16x4096              65536      58.00     1.700      55.10     1.800   0.950    95.0%  rpw=16 wpb=8 bps=4
== run 2
prefill_4x4096               16384      16.80     1.500      14.62     1.700   0.870    87.0%  rpw=4 wpb=4 bps=8
"""

BYTES = """\
== compact bytes decode step (256 sequences x 61 layers)
latency    p50 8310 us, p90 18740 us, p99 31057 us, max 150220 us
== ingest, one connection
rows       3619840 rows, 4.170 GB of input rows: 2.430 GB/s
latency    p50 3686 us, p90 5095 us, p99 8398 us, max 14056 us
== ingest, eight connections
rows       4609024 rows, 5.310 GB of input rows: 9.990 GB/s
"""

SAVE = """\
byte-exact: 61 layers x 300 and x 4096 tokens saved by reference == sent as bytes
{"tokens": 1024, "overhead_pct": 33.3, "last_compute_to_commit_ms": 0.72, "commit": "call"}
{"tokens": 4096, "overhead_pct": 4.8, "last_compute_to_commit_ms": 1.08, "commit": "call"}
{"tokens": 4096, "overhead_pct": 6.1, "last_compute_to_commit_ms": 0.97, "commit": "end"}
exit 0
"""


def summary(files):
    with tempfile.TemporaryDirectory() as out:
        for name, text in files.items():
            with open(os.path.join(out, name), "w") as f:
                f.write(text)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = aims.main_for(out)
        return rc, buf.getvalue().splitlines()


class AimsSummaryTest(unittest.TestCase):
    def verdict(self, lines, aim):
        matches = [line for line in lines if aim in line]
        self.assertEqual(len(matches), 1, "%r in %s" % (aim, list(lines)))
        return matches[0]

    def test_every_aim_judged_from_its_line(self):
        rc, lines = summary({"floor.txt": FLOOR, "ipc.txt": IPC, "kernel.txt": KERNEL, "bytes.txt": BYTES,
                             "save.txt": SAVE})
        self.assertEqual(rc, 0)
        # The first table (each server alone in turn), not the one beside.
        self.assertIn("1.12x  -> met in 1 of 1", self.verdict(lines, "GetPool p50 / minimal sync"))
        # The LENGTHS view's line, not AppendBatch's FULL view (+149.3).
        self.assertIn("+325.3 us, +140.0 us  -> met in 1 of 2", self.verdict(lines, "262,144-row"))
        self.assertIn("1.30x, 1.31x  -> met in 1 of 2", self.verdict(lines, "one-row IPC append"))
        # PACKED, not the compact default view (635.1) or COMPACT (568.8).
        self.assertIn("294.2 us, 432.0 us  -> met in 1 of 2", self.verdict(lines, "p50 <= 300 us"))
        self.assertIn("999 us, 2199 us  -> met in 1 of 2", self.verdict(lines, "p99 <= 1 ms"))
        self.assertIn("1.19x, 1.32x  -> met in 1 of 2", self.verdict(lines, "one launch <= 1.3x"))
        self.assertIn("88.0%, 87.0%  -> met in 1 of 2", self.verdict(lines, "16,384 rows"))
        self.assertIn("92.0%  -> met in 1 of 1", self.verdict(lines, "32,768 rows"))
        self.assertIn("8.31 ms  -> met in 1 of 1", self.verdict(lines, "compact bytes"))
        self.assertIn("2.43 GB/s  -> met in 1 of 1", self.verdict(lines, "one connection"))
        self.assertIn("9.99 GB/s  -> met in 0 of 1", self.verdict(lines, "eight connections"))
        self.assertIn("1.08 ms, 0.97 ms  -> met in 1 of 2", self.verdict(lines, "last compute -> commit"))
        self.assertIn("4.8%, 6.1%  -> met in 1 of 2", self.verdict(lines, "overhead < 5%"))

    def test_a_part_that_printed_nothing_is_not_measured(self):
        # A bench that crashed before its figures: never "met".
        rc, lines = summary({"ipc.txt": "== round 1: mlakv-server\nipc_append_bench: cudaMalloc failed\n",
                             "kernel.txt": "", "save.txt": "Traceback (most recent call last):\n"})
        self.assertEqual(rc, 0)
        for aim in ("262,144-row", "p50 <= 300 us", "16,384 rows", "last compute -> commit"):
            self.assertIn("not measured", self.verdict(lines, aim))
        self.assertFalse(any("met in" in line for line in lines))
        # The parts not run are left out.
        self.assertFalse(any("GetPool p50 / minimal sync" in line for line in lines))

    def test_no_part_at_all(self):
        rc, lines = summary({})
        self.assertEqual(rc, 1)
        self.assertTrue(any("no part's file" in line for line in lines))


class PhasesSummaryTest(unittest.TestCase):
    LOG = """\
2026-12-07T09:38:01.1Z debug cuda backend append: layers=1 rows=262144 bytes_staged=16400 us: stage=9.0 enqueue=50.0 sync=137.0 gpu_to_kernel=19.0 gpu_kernel=152.0
2026-12-07T09:38:01.2Z debug AppendBatch pool='' sequences=1 rows=262144 us: checks=2 wait=8 prepare=7 stage=266 commit=5 respond=8: OK
2026-12-07T09:38:01.3Z debug cuda backend append: layers=1 rows=262144 bytes_staged=16400 us: stage=11.0 enqueue=52.0 sync=139.0 gpu_to_kernel=21.0 gpu_kernel=154.0
2026-12-07T09:38:01.4Z debug AppendBatch pool='' sequences=1 rows=262144 us: checks=2 wait=8 prepare=9 stage=270 commit=5 respond=8: OK
2026-12-07T09:38:01.5Z debug cuda backend append: layers=1 rows=262144 bytes_staged=16400 us: stage=10.0 enqueue=51.0 sync=138.0 gpu_to_kernel=20.0 gpu_kernel=153.0
2026-12-07T09:38:01.6Z debug GetPool pool='': OK
2026-12-07T09:38:02.0Z debug cuda backend append: layers=61 rows=256 bytes_staged=9000 us: stage=16.7 enqueue=41.2 sync=14.7 gpu_to_kernel=13.1 gpu_kernel=29.6
"""

    def test_medians_per_kind_and_size(self):
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
            f.write(self.LOG)
        self.addCleanup(os.unlink, f.name)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = phases.main_for(f.name)
        self.assertEqual(rc, 0)
        out = {line.split(":")[0]: line for line in buf.getvalue().splitlines()}
        self.assertEqual(set(out), {"AppendBatch, rows=262144 (2 calls)", "backend, rows=262144 x 1 layers (3 calls)",
                                    "backend, rows=256 x 61 layers (1 calls)"})
        self.assertIn("stage p50 10.0", out["backend, rows=262144 x 1 layers (3 calls)"])
        self.assertIn("gpu_kernel p50 153.0", out["backend, rows=262144 x 1 layers (3 calls)"])
        self.assertIn("prepare p50 8.0", out["AppendBatch, rows=262144 (2 calls)"])

    def test_a_log_without_timed_lines(self):
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
            f.write("2026-12-07T09:38:01.6Z warn something\n")
        self.addCleanup(os.unlink, f.name)
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(phases.main_for(f.name), 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
