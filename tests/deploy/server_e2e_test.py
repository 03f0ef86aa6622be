#!/usr/bin/python3
"""mlakv-server as deployed: metrics, TLS, token, health probe port, drain.

A real mlakv-server process on loopback ports (--device cpu), driven by the
Python client (client/python) and the `mlakv` CLI:

  * MetricsAfterWorkload: a known workload (appends, a batch, errors, a free),
    then GET /metrics: `promtool check metrics` accepts the scrape and the
    counters and gauges equal the workload.
  * Tls*: --tls_cert/--tls_key/--tls_client_ca/--auth_token_file with
    certificates made now by openssl: plaintext, missing client cert, a
    client cert of another CA, no token, wrong token are all refused (the
    token cases with UNAUTHENTICATED); the right cert + token work from the
    CLI and the Python client; health needs no token; the --health_listen
    port serves health only; refusals are counted in mlakv_auth_failures_total.
  * DrainOnSigterm: with an Append stream open, SIGTERM turns health
    NOT_SERVING, mlakv_draining to 1, refuses new calls, cancels the stream
    after --drain_grace_s and exits 0.
  * MetricsEndpointUnderSlowClients: stalled connections to the metrics port
    do not delay scrapes; SIGTERM exits in well under 1.5 s with no stalled
    metrics client, and within civetweb's 2 s poll quantum (< 3 s) with some.
  * PortInUse: the gRPC, health and metrics ports of a running server are
    refused to a second one (exit 1).
  * Bad security flags stop the server at start with exit status 2.

Environment: MLAKV_SERVER, MLAKV_CLI, MLAKV_PY_GEN (generated Python stubs),
PYTHONPATH containing client/python; promtool and openssl on PATH.
"""
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import grpc
import numpy as np

import mlakv
from mlakv.v1 import kv_cache_pb2 as pb
from mlakv.v1 import kv_cache_pb2_grpc as pb_grpc

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.environ.get("MLAKV_SERVER", "")
CLI = os.environ.get("MLAKV_CLI", "")
START_TIMEOUT_S = 30
KV = "mlakv.v1.KvCache"


class Server:
    """mlakv-server on 127.0.0.1 port 0; ports read from its start-up log."""

    def __init__(self, *args):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mlakv-e2e-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [SERVER, "--listen", "127.0.0.1:0", "--device", "cpu", "--metrics_listen", "127.0.0.1:0", *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        self.ready_line = None
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"^.*ready: grpc (\S+) .*$", self.text(), re.M)
            if m:
                self.ready_line = m.group(0)
                break
            time.sleep(0.05)
        if self.ready_line is None:
            self.stop()
            self.log.close()
            raise RuntimeError("mlakv-server did not start:\n" + self.text())
        self.target = re.search(r"ready: grpc (\S+)", self.ready_line).group(1)
        m = re.search(r"metrics port (\d+)", self.ready_line)
        self.metrics_port = int(m.group(1)) if m else None
        m = re.search(r"health probe port (\d+)", self.ready_line)
        self.health_port = int(m.group(1)) if m else None

    def text(self):
        with open(self.log.name) as f:
            return f.read()

    def scrape(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.metrics_port, timeout=5) as r:
            # prometheus::Exposer answers "text/plain; charset=utf-8", without
            # version=0.0.4: Prometheus reads that as the text format 0.0.4.
            assert r.headers.get_content_type() == "text/plain", r.headers["Content-Type"]
            return r.read().decode()

    def stop(self, sig=signal.SIGTERM, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self):
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def parse_metrics(text):
    """{(name, frozenset(labels.items())): value}"""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
        assert m, "unparsable sample line: %r" % line
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def promtool_check(text):
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def rows(n, seed):
    """n bf16 rows (uint16 bit patterns) of ckv [n,512] and kpe [n,64]."""
    rng = np.random.default_rng(seed)
    f = lambda w: (rng.standard_normal((n, w)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return f(512), f(64)


class MetricsAfterWorkload(unittest.TestCase):
    def test_scrape_matches_workload(self):
        srv = Server("--log_level", "info")
        self.addCleanup(srv.close)
        # The one start-up line: version, grpc address, security, rpc threads, pools with device and bytes.
        self.assertRegex(srv.ready_line, r"mlakv-server \d+\.\d+\.\d+ ready: grpc 127\.0\.0\.1:\d+ \(plaintext, \d+ rpc threads\), "
                                         r"metrics port \d+, health probe off, kv events off, pools \[default@cpu 256x64x61L "
                                         r"[\d.]+ MiB\], cache [\d.]+ MiB \(\d+ bytes\)")

        c = mlakv.Client(srv.target, timeout=30)
        self.addCleanup(c.close)
        c.wait_ready()
        before = parse_metrics(srv.scrape())

        # Workload: 3 sequences x 2 layers x 100 rows (6 Append calls), one
        # AppendBatch of 1 row for each sequence in layer 0, one append with a
        # hole (refused), one GetSequence of an unknown id, one free.
        n = 100
        for s in range(3):
            for layer in (0, 1):
                ckv, kpe = rows(n, seed=10 * s + layer)
                c.append("seq-%d" % s, layer, ckv, kpe, start=0, ckv_scale=1.0, kpe_scale=1.0)
        batch = []
        for s in range(3):
            ckv, kpe = rows(1, seed=100 + s)
            batch.append(mlakv.SequenceRows("seq-%d" % s, {0: (ckv, kpe)}, start=n))
        c.append_batch(batch, ckv_scale=1.0, kpe_scale=1.0)
        ckv, kpe = rows(4, seed=7)
        with self.assertRaises(mlakv.Error) as hole:
            c.append("seq-0", 1, ckv, kpe, start=n + 50)
        with self.assertRaises(mlakv.Error) as missing:
            c.sequence("no-such-sequence")
        self.assertEqual(missing.exception.code, grpc.StatusCode.NOT_FOUND)
        c.free("seq-2")
        # And one call through the CLI.
        out = subprocess.run([CLI, "pools", "--server", srv.target], capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)

        text = srv.scrape()
        rc, msg = promtool_check(text)
        self.assertEqual(rc, 0, "promtool check metrics:\n" + msg)
        m = parse_metrics(text)
        d = lambda name, **l: value(m, name, **l) - value(before, name, **l)

        hole_code = hole.exception.code.name
        self.assertEqual(d("mlakv_rpcs_total", service=KV, method="Append", code="OK"), 6)
        self.assertEqual(d("mlakv_rpcs_total", service=KV, method="Append", code=hole_code), 1)
        self.assertEqual(d("mlakv_rpc_errors_total", service=KV, method="Append", code=hole_code), 1)
        self.assertEqual(d("mlakv_rpcs_total", service=KV, method="AppendBatch", code="OK"), 1)
        self.assertEqual(d("mlakv_rpcs_total", service=KV, method="GetSequence", code="NOT_FOUND"), 1)
        self.assertEqual(d("mlakv_rpc_errors_total", service=KV, method="GetSequence", code="NOT_FOUND"), 1)
        self.assertEqual(d("mlakv_rpcs_total", service=KV, method="FreeSequence", code="OK"), 1)
        self.assertEqual(d("mlakv_rpcs_total", service=KV, method="ListPools", code="OK"), 1)
        self.assertEqual(d("mlakv_rpc_errors_total", service=KV, method="Append", code="OK"), 0)
        self.assertEqual(d("mlakv_rpc_latency_seconds_count", service=KV, method="Append"), 7)
        # Rows: one row = one token of one layer; bytes: ckv + kpe, bf16.
        self.assertEqual(d("mlakv_appended_rows_total", pool="default", method="Append"), 6 * n)
        self.assertEqual(d("mlakv_appended_rows_total", pool="default", method="AppendBatch"), 3)
        self.assertEqual(d("mlakv_appended_bytes_total", pool="default", method="Append"), 6 * n * 576 * 2)
        self.assertEqual(d("mlakv_appended_bytes_total", pool="default", method="AppendBatch"), 3 * 576 * 2)
        self.assertEqual(d("mlakv_append_latency_seconds_count", method="Append"), 7)
        self.assertEqual(d("mlakv_append_latency_seconds_count", method="AppendBatch"), 1)
        # The kernel ran for every successful append, and took time.
        self.assertGreaterEqual(d("mlakv_kernel_calls_total", pool="default", device="cpu"), 7)
        self.assertGreater(d("mlakv_kernel_seconds_total", pool="default", device="cpu"), 0)
        # The backend runs on the pool's worker: its busy time holds all the kernel time, and it is idle now.
        self.assertGreaterEqual(value(m, "mlakv_pool_worker_busy_seconds_total", pool="default"),
                                value(m, "mlakv_kernel_seconds_total", pool="default", device="cpu"))
        self.assertEqual(value(m, "mlakv_pool_worker_tasks", pool="default"), 0)
        # The transport threads (small appends here release on the worker): exposed, nothing left queued.
        self.assertIn(("mlakv_transport_busy_seconds_total", frozenset()), m)
        self.assertEqual(value(m, "mlakv_transport_tasks"), 0)
        # Gauges at scrape time: 2 sequences of 101 tokens (layer 0) = 2 pages each.
        pages = 2 * math.ceil((n + 1) / 64)
        self.assertEqual(value(m, "mlakv_pool_sequences", pool="default"), 2)
        self.assertEqual(value(m, "mlakv_pool_pages_used", pool="default", device="cpu"), pages)
        self.assertEqual(value(m, "mlakv_pool_pages_free", pool="default", device="cpu"), 256 - pages)
        self.assertEqual(value(m, "mlakv_pool_pages_capacity", pool="default", device="cpu"), 256)
        self.assertGreater(value(m, "mlakv_pool_cache_bytes", pool="default", device="cpu"), 0)
        self.assertEqual(value(m, "mlakv_ipc_regions"), 0)
        self.assertEqual(value(m, "mlakv_draining"), 0)
        # The version of the ready line, and the allocator the build linked (tcmalloc, cmake/allocator.cmake),
        # found in the running process: a linker that dropped the library would leave glibc's malloc.
        build_info = [labels for (name, labels) in m if name == "mlakv_build_info"]
        self.assertEqual(len(build_info), 1, build_info)
        labels = dict(build_info[0])
        self.assertEqual(labels["version"], re.search(r"mlakv-server (\S+)", srv.ready_line).group(1))
        expected_malloc = os.environ.get("MLAKV_EXPECTED_MALLOC_LIBRARY", "")
        if expected_malloc and expected_malloc != "system":
            self.assertEqual(labels["allocator"], expected_malloc)
        else:  # the system's, or a sanitizer's inside the program
            self.assertNotIn("tcmalloc", labels["allocator"])
        self.assertEqual(value(m, "mlakv_build_info", **labels), 1)
        self.assertEqual(value(m, "mlakv_rpcs_in_flight", service=KV, method="Append"), 0)
        # The Exposer's own series come along (they pass promtool too).
        self.assertGreaterEqual(value(m, "exposer_scrapes_total"), 1)
        # Nothing but /metrics is served.
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen("http://127.0.0.1:%d/" % srv.metrics_port, timeout=5)
        self.assertEqual(e.exception.code, 404)


class Tls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pki = tempfile.mkdtemp(prefix="mlakv-pki-")
        subprocess.run(["sh", os.path.join(HERE, "make_test_certs.sh"), cls.pki], check=True,
                       stdout=subprocess.DEVNULL)
        cls.srv = Server("--tls_cert", cls.f("server.crt"), "--tls_key", cls.f("server.key"),
                         "--tls_client_ca", cls.f("ca.crt"), "--auth_token_file", cls.f("token"),
                         "--health_listen", "127.0.0.1:0")
        # The certificate names localhost and 127.0.0.1; connect by name.
        cls.target = cls.srv.target.replace("127.0.0.1", "localhost")

    @classmethod
    def tearDownClass(cls):
        cls.srv.close()
        shutil.rmtree(cls.pki)

    @classmethod
    def f(cls, name):
        return os.path.join(cls.pki, name)

    def cli(self, *flags):
        p = subprocess.run([CLI, "pools", "--server", self.target, "--timeout_s", "10", *flags],
                           capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout + p.stderr

    def mtls(self, who="client"):
        return ["--tls_ca", self.f("ca.crt"), "--tls_cert", self.f(who + ".crt"), "--tls_key", self.f(who + ".key")]

    def creds(self, who="client"):
        def read(name):
            with open(self.f(name), "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(read("ca.crt"), read(who + ".key"), read(who + ".crt"))

    def auth_failures(self):
        m = parse_metrics(self.srv.scrape())
        return value(m, "mlakv_auth_failures_total", reason="missing"), value(m, "mlakv_auth_failures_total",
                                                                              reason="invalid")

    def test_cli_refusals_and_success(self):
        self.assertIn("tls+mtls+token", self.srv.ready_line)
        missing0, invalid0 = self.auth_failures()
        rc, out = self.cli()  # plaintext against TLS
        self.assertEqual(rc, 1, out)
        self.assertIn("UNAVAILABLE", out)
        rc, out = self.cli("--tls_ca", self.f("ca.crt"), "--token_file", self.f("token"))  # no client cert
        self.assertEqual(rc, 1, out)
        self.assertIn("UNAVAILABLE", out)
        rc, out = self.cli(*self.mtls("other-client"), "--token_file", self.f("token"))  # cert of another CA
        self.assertEqual(rc, 1, out)
        self.assertIn("UNAVAILABLE", out)
        rc, out = self.cli(*self.mtls())  # no token
        self.assertEqual(rc, 1, out)
        self.assertIn("UNAUTHENTICATED", out)
        rc, out = self.cli(*self.mtls(), "--token_file", self.f("wrong-token"))
        self.assertEqual(rc, 1, out)
        self.assertIn("UNAUTHENTICATED", out)
        rc, out = self.cli(*self.mtls(), "--token_file", self.f("token"))
        self.assertEqual(rc, 0, out)
        self.assertIn("default", out)
        # By IP, naming the certificate's host.
        p = subprocess.run([CLI, "pools", "--server", self.srv.target, *self.mtls(), "--token_file",
                            self.f("token"), "--tls_server_name", "localhost"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        missing1, invalid1 = self.auth_failures()
        self.assertEqual((missing1 - missing0, invalid1 - invalid0), (1, 1))
        # A token without TLS is refused by the client before sending it.
        rc, out = self.cli("--token_file", self.f("token"))
        self.assertEqual(rc, 1, out)
        self.assertIn("needs TLS", out)

    def test_python_client_token_and_tls(self):
        with open(self.f("token")) as f:
            token = f.read().strip()
        with mlakv.Client(self.target, credentials=self.creds(), token=token, timeout=10) as c:
            self.assertEqual([p.name for p in c.pools()], ["default"])
        with mlakv.Client(self.target, credentials=self.creds(), timeout=10) as c:
            self.assertEqual(c.health(), "SERVING")  # health needs no token
            with self.assertRaises(mlakv.Error) as e:
                c.pools()
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
        with mlakv.Client(self.target, credentials=self.creds(), token="not-" + token, timeout=10) as c:
            with self.assertRaises(mlakv.Error) as e:
                c.pools()
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)

    def test_health_probe_port_serves_health_only(self):
        ch = grpc.insecure_channel("127.0.0.1:%d" % self.srv.health_port)
        self.addCleanup(ch.close)
        check = ch.unary_unary("/grpc.health.v1.Health/Check")
        self.assertEqual(check(b"", timeout=10), b"\x08\x01")  # status: SERVING
        with self.assertRaises(grpc.RpcError) as e:
            pb_grpc.KvCacheStub(ch).ListPools(pb.ListPoolsRequest(), timeout=10)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNIMPLEMENTED)


class DrainOnSigterm(unittest.TestCase):
    def test_drain(self):
        srv = Server("--health_listen", "127.0.0.1:0", "--drain_grace_s", "3")
        self.addCleanup(srv.close)
        ch = grpc.insecure_channel(srv.target)
        self.addCleanup(ch.close)
        stub = pb_grpc.KvCacheStub(ch)
        probe = grpc.insecure_channel("127.0.0.1:%d" % srv.health_port)
        self.addCleanup(probe.close)
        check = probe.unary_unary("/grpc.health.v1.Health/Check")
        self.assertEqual(check(b"", timeout=10), b"\x08\x01")

        # An Append stream that sends one message and then waits.
        release = threading.Event()
        ckv, kpe = rows(8, seed=1)

        def messages():
            yield pb.AppendRequest(sequence="drain", start=0, row_count=8, dtype=pb.ROW_DTYPE_BFLOAT16,
                                   layers=[pb.LayerRows(layer=0, ckv=ckv.tobytes(), kpe=kpe.tobytes(),
                                                        ckv_scale=1.0, kpe_scale=1.0)])
            release.wait(30)

        result = {}

        def run_stream():
            try:
                stub.Append(messages(), timeout=30)
                result["code"] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                result["code"] = e.code()

        t = threading.Thread(target=run_stream)
        t.start()
        self.addCleanup(release.set)
        deadline = time.monotonic() + 10
        while value(parse_metrics(srv.scrape()), "mlakv_rpcs_in_flight", service=KV, method="Append") != 1:
            self.assertLess(time.monotonic(), deadline, "the Append stream never showed as in flight")
            time.sleep(0.05)

        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # Health turns NOT_SERVING on the probe port; metrics say draining.
        status = None
        while time.monotonic() - t0 < 2.5:
            try:
                status = check(b"", timeout=1)
            except grpc.RpcError as e:
                status = e.code()
            if status == b"\x08\x02":
                break
            time.sleep(0.05)
        self.assertEqual(status, b"\x08\x02", "health did not turn NOT_SERVING during the drain")
        self.assertEqual(value(parse_metrics(srv.scrape()), "mlakv_draining"), 1)
        # New calls are refused while the stream drains.
        with self.assertRaises(grpc.RpcError) as e:
            grpc_ch = grpc.insecure_channel(srv.target)
            try:
                pb_grpc.KvCacheStub(grpc_ch).ListPools(pb.ListPoolsRequest(), timeout=2)
            finally:
                grpc_ch.close()
        self.assertIn(e.exception.code(), (grpc.StatusCode.UNAVAILABLE,))
        # The grace period (3 s) ends the stream; the process exits cleanly.
        rc = srv.proc.wait(15)
        elapsed = time.monotonic() - t0
        t.join(10)
        self.assertEqual(rc, 0, srv.text())
        self.assertGreaterEqual(elapsed, 2.5, "exited before the grace period with a call in flight")
        self.assertLess(elapsed, 10, "drain took far longer than --drain_grace_s 3")
        self.assertNotEqual(result.get("code"), grpc.StatusCode.OK)
        log = srv.text()
        self.assertIn("received SIGTERM", log)
        self.assertIn("stopped", log)


class BadFlags(unittest.TestCase):
    def run_server(self, *args):
        p = subprocess.run([SERVER, "--listen", "127.0.0.1:0", "--device", "cpu", *args], capture_output=True,
                           text=True, timeout=30)
        return p.returncode, p.stdout + p.stderr

    def test_token_without_tls_refused(self):
        with tempfile.NamedTemporaryFile("w") as tok:
            tok.write("abc\n")
            tok.flush()
            rc, out = self.run_server("--auth_token_file", tok.name)
        self.assertEqual(rc, 2, out)
        self.assertIn("--auth_token_file needs --tls_cert", out)

    def test_cert_without_key_refused(self):
        rc, out = self.run_server("--tls_cert", "/nonexistent.crt")
        self.assertEqual(rc, 2, out)
        self.assertIn("--tls_cert and --tls_key go together", out)

    def test_bad_log_level_refused(self):
        rc, out = self.run_server("--log_level", "loud")
        self.assertEqual(rc, 2, out)
        self.assertIn("--log_level", out)

    def test_bad_metrics_address_refused(self):
        rc, out = self.run_server("--metrics_listen", "nonsense")
        self.assertNotEqual(rc, 0, out)
        self.assertIn("--metrics_listen", out)


class PortInUse(unittest.TestCase):
    """A second server on a port another one serves exits with an error; it
    never shares the port (gRPC's default SO_REUSEPORT would let it take half
    of the first one's connections)."""

    def test_grpc_health_and_metrics_ports_in_use_are_refused(self):
        srv = Server("--health_listen", "127.0.0.1:0")
        self.addCleanup(srv.close)
        metrics = "127.0.0.1:%d" % srv.metrics_port
        for args, expected in ((["--listen", srv.target], "cannot listen on '%s'" % srv.target),
                               (["--listen", "127.0.0.1:0", "--health_listen", "127.0.0.1:%d" % srv.health_port],
                                "--health_listen 127.0.0.1:%d: cannot listen there" % srv.health_port),
                               (["--listen", "127.0.0.1:0", "--metrics_listen", metrics],
                                "--metrics_listen: cannot listen on '%s'" % metrics)):
            with self.subTest(args=args):
                p = subprocess.run([SERVER, "--device", "cpu", *args], capture_output=True, text=True, timeout=30)
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                self.assertIn(expected, p.stdout + p.stderr)
        with mlakv.Client(srv.target, timeout=10) as c:  # the first server is unaffected
            self.assertEqual([p.name for p in c.pools()], ["default"])
        self.assertIn("mlakv_build_info", srv.scrape())  # and so is its metrics port


class MetricsEndpointUnderSlowClients(unittest.TestCase):
    """The real process: connections to the metrics port that send half a
    request head and stall do not delay scrapes. SIGTERM ends the process at
    once when no metrics client is stalled; a client stalled mid-request can
    hold the exit up by civetweb's 2 s poll quantum (server/observability/metrics_endpoint.h),
    never by the 5 s request timeout."""

    def stalled(self, port, n):
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(s)
            self.addCleanup(s.close)
        return socks

    def sigterm_exit_seconds(self, srv):
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(15)
        took = time.monotonic() - t0
        self.assertEqual(rc, 0, srv.text())
        return took

    def test_scrapes_with_stalled_connections(self):
        srv = Server()
        self.addCleanup(srv.close)
        self.stalled(srv.metrics_port, 3)  # the endpoint serves 4 connections at once
        time.sleep(0.2)
        for _ in range(3):
            t0 = time.monotonic()
            text = srv.scrape()
            self.assertLess(time.monotonic() - t0, 1.0, "a scrape waited behind stalled connections")
            self.assertIn("mlakv_build_info", text)

    def test_sigterm_exit_is_prompt_without_stalled_clients(self):
        srv = Server()
        self.addCleanup(srv.close)
        for _ in range(3):
            self.assertIn("mlakv_build_info", srv.scrape())
        time.sleep(0.5)  # somewhere inside civetweb's 2 s accept poll
        took = self.sigterm_exit_seconds(srv)
        print("\nSIGTERM to exit, no stalled metrics client: %.3f s" % took, file=sys.stderr)
        self.assertLess(took, 1.5, "exit waited for civetweb's accept poll")

    def test_sigterm_exit_with_stalled_clients_is_bounded_by_the_poll_quantum(self):
        srv = Server()
        self.addCleanup(srv.close)
        self.stalled(srv.metrics_port, 3)
        time.sleep(0.2)
        self.assertIn("mlakv_build_info", srv.scrape())
        took = self.sigterm_exit_seconds(srv)
        print("\nSIGTERM to exit, 3 stalled metrics clients: %.3f s" % took, file=sys.stderr)
        # civetweb's 2 s poll quantum plus the process's own stop; less than
        # the 5 s request timeout the stalled clients would otherwise get.
        self.assertLess(took, 3.0, "exit waited for more than civetweb's 2 s poll quantum")


if __name__ == "__main__":
    for tool in ("promtool", "openssl"):
        if shutil.which(tool) is None:
            print("FAIL: %s not found (scripts/install_deps.sh installs it)" % tool)
            sys.exit(1)
    for var, path in (("MLAKV_SERVER", SERVER), ("MLAKV_CLI", CLI)):
        if not path or not os.access(path, os.X_OK):
            print("FAIL: %s=%r is not an executable" % (var, path))
            sys.exit(1)
    unittest.main(verbosity=2)
