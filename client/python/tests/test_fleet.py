"""mlakv.Fleet and `mlakv --servers` against three real mlakv-server processes
on 127.0.0.2, 127.0.0.3 and 127.0.0.4 (a fourth on 127.0.0.5 joins through
an injected resolver; the machine's resolver is never touched)."""

import os
import socket
import subprocess
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

import mlakv
from mlakv import fleet as fleet_mod
from server_process import ServerProcess

CONFIG = ('pools { name: "p" device: "cpu" num_layers: 1 page_size: 16 num_pages: 4096 max_sequences: 8192 '
          'layer_scales { layer: 0 ckv_scale: 1 kpe_scale: 1 } }\n')
CKV = np.zeros((1, 512), np.float16)
KPE = np.zeros((1, 64), np.float16)


def write_config():
    f = tempfile.NamedTemporaryFile("w", prefix="mlakv-fleet-", suffix=".txtpb", delete=False)
    f.write(CONFIG)
    f.close()
    return f.name


def start(host, server_id, config, port=0):
    s = ServerProcess("--server_id", server_id, "--config", config, host=host, port=port)
    return s.start()


def stop_all(servers):
    for s in servers:
        s.__exit__(None, None, None)  # stops it and removes its log


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


class WeightsTest(unittest.TestCase):
    def test_the_weights_are_the_cpp_clients(self):
        # The numbers tests/client/rendezvous_test.cc pins for the C++ client.
        self.assertEqual(fleet_mod.fnv1a64(b"a"), 0xAF63DC4C8601EC8C)
        self.assertEqual(fleet_mod.mix64(1), 0x5692161D100B05E5)
        self.assertEqual(fleet_mod.weight("req-1", "127.0.0.2:50051"), 0xFE218170F032DB47)
        self.assertEqual(fleet_mod.weight("req-1", "127.0.0.3:50051"), 0x1B67BB7B819B033D)
        self.assertEqual(fleet_mod.weight("", "10.0.0.1:50051"), 0xBA77EBE0B97C8297)
        self.assertEqual(fleet_mod.weight("seq-\u00e9", "[::1]:1"), 0x1D96A2E0803372C1)
        self.assertEqual(fleet_mod.pick("req-1", ["127.0.0.3:50051", "127.0.0.2:50051"]), "127.0.0.2:50051")
        self.assertIsNone(fleet_mod.pick("x", []))

    def test_bad_sets_are_refused(self):
        for kwargs in ({}, {"servers": ["a:1"], "service": "dns:///x:1"}, {"servers": ["a:1", "a:1"]},
                       {"service": "mlakv:50051"}, {"service": "dns:///mlakv"}):
            with self.assertRaises(ValueError, msg=str(kwargs)):
                mlakv.Fleet(refresh_interval=0, **kwargs)


class ListedFleetTest(unittest.TestCase):
    """Three servers named by a list; the CLI driven with --servers."""

    @classmethod
    def setUpClass(cls):
        cls.config = write_config()
        cls.servers = [start("127.0.0.%d" % i, "mlakv-%d" % i, cls.config) for i in (2, 3, 4)]
        cls.targets = [s.target for s in cls.servers]
        cls.cli = os.environ.get("MLAKV_CLI")

    @classmethod
    def tearDownClass(cls):
        stop_all(cls.servers)
        os.unlink(cls.config)

    def run_cli(self, *args):
        if not self.cli:
            self.skipTest("MLAKV_CLI is not set (path of the mlakv binary)")
        return subprocess.run([self.cli] + list(args) + ["--servers", ",".join(self.targets)],
                              capture_output=True, text=True, timeout=60)

    def test_1_three_thousand_sequences_spread_evenly_and_live_on_their_owner_only(self):
        with mlakv.Fleet(servers=self.targets, refresh_interval=0, timeout=30) as fleet:
            self.assertEqual([s[1] for s in fleet.servers()], ["mlakv-2", "mlakv-3", "mlakv-4"])
            owners = {}
            for i in range(3000):
                sid = "req-%d" % i
                fleet.append(sid, layer=0, ckv=CKV, kpe=KPE, start=0, pool="p")
                owners[sid] = fleet.owner_of(sid)
            counts = {}
            for owner in owners.values():
                counts[owner] = counts.get(owner, 0) + 1
            self.assertEqual(sorted(counts), ["mlakv-2", "mlakv-3", "mlakv-4"])
            for server, n in counts.items():
                self.assertLess(abs(n - 1000), 150, "%s holds %d of 3000" % (server, n))
            listed = fleet.sequences("p")
            self.assertEqual(listed.failures, [])
            where = {}
            for server_id, summaries in listed.answers.items():
                for s in summaries:
                    where.setdefault(s.id, []).append(server_id)
            self.assertEqual(len(where), 3000)
            for sid, servers in where.items():
                self.assertEqual(servers, [owners[sid]], sid)
            # The CLI (which records nothing) places them the same way.
            for sid in ("req-0", "req-1", "req-2", "req-999", "req-2999"):
                out = self.run_cli("seq", sid, "--pool", "p", "--json")
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn('"server_id":"%s"' % owners[sid], out.stdout.replace(" ", ""))
            out = self.run_cli("seqs", "--pool", "p")
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("3000 sequence(s) in pool p on 3 server(s)", out.stdout)
            out = self.run_cli("pools")
            self.assertEqual(out.returncode, 0, out.stderr)
            for i in (2, 3, 4):
                self.assertIn("mlakv-%d" % i, out.stdout)
            # A command that names no sequence needs --server_id.
            out = self.run_cli("page", "0", "--pool", "p")
            self.assertEqual(out.returncode, 1)
            self.assertIn("--server_id", out.stderr)
            out = self.run_cli("page", "0", "--pool", "p", "--server_id", "mlakv-3")
            self.assertEqual(out.returncode, 0, out.stderr)

    def test_1b_a_layerwise_save_goes_to_the_owner_and_is_recorded_on_commit(self):
        with mlakv.Fleet(servers=self.targets, refresh_interval=0, timeout=30) as fleet:
            placed = {}
            for i in range(30):
                sid = "saved-%d" % i
                with fleet.save(sid, pool="p") as s:
                    for layer in range(1):
                        s.layer(layer, np.zeros((300, 512), np.float16), np.zeros((300, 64), np.float16))
                placed[sid] = fleet.owner_of(sid)
                self.assertEqual(fleet.sequence(sid, pool="p").server_id, placed[sid])
            self.assertGreater(len(set(placed.values())), 1, "30 saves all on one server")
            # A failed save records nothing.
            s = fleet.save("never", pool="p")
            s.layer(0, np.zeros((300, 500), np.float16), np.zeros((300, 64), np.float16))
            with self.assertRaises(mlakv.Error):
                s.wait()
            self.assertIsNone(fleet.owner_of("never"))
            for sid in placed:
                fleet.free(sid, pool="p")

    def test_2_a_killed_server_fails_only_its_own_sequences_naming_it(self):
        with mlakv.Fleet(servers=self.targets, refresh_interval=0, timeout=30) as fleet:
            owners = {}
            for i in range(300):
                sid = "k-%d" % i
                fleet.append(sid, layer=0, ckv=CKV, kpe=KPE, start=0, pool="p")
                owners[sid] = fleet.owner_of(sid)
            dead = self.servers[1]
            dead.proc.kill()
            dead.proc.wait()
            t0 = time.monotonic()
            failed = 0
            for sid, owner in owners.items():
                if owner == "mlakv-3":
                    with self.assertRaises(mlakv.Error) as ctx:
                        fleet.sequence(sid, pool="p")
                    self.assertEqual(ctx.exception.code, grpc.StatusCode.UNAVAILABLE)
                    self.assertIn("mlakv-3", ctx.exception.message)
                    self.assertIn(dead.target, ctx.exception.message)
                    failed += 1
                else:
                    self.assertEqual(fleet.sequence(sid, pool="p").server_id, owner)
            self.assertGreater(failed, 50)
            self.assertLess(time.monotonic() - t0, 5.0, "failures must be fast")
            for i in range(100):
                sid = "after-%d" % i
                fleet.append(sid, layer=0, ckv=CKV, kpe=KPE, start=0, pool="p")
                self.assertNotEqual(fleet.owner_of(sid), "mlakv-3")
            pools = fleet.pools()
            self.assertEqual(sorted(pools.answers), ["mlakv-2", "mlakv-4"])
            self.assertEqual(len(pools.failures), 1)
            self.assertEqual(pools.failures[0].code, grpc.StatusCode.UNAVAILABLE)
            # The CLI: the dead server's sequence fails UNAVAILABLE naming it.
            sid = next(s for s, o in owners.items() if o == "mlakv-3")
            out = self.run_cli("seq", sid, "--pool", "p")
            self.assertEqual(out.returncode, 1)
            self.assertIn("UNAVAILABLE", out.stderr)
            self.assertIn(dead.target, out.stderr)
            alive = next(s for s, o in owners.items() if o != "mlakv-3")
            self.assertEqual(self.run_cli("seq", alive, "--pool", "p").returncode, 0)
            out = self.run_cli("pools")
            self.assertEqual(out.returncode, 1)
            self.assertIn(dead.target, out.stderr)


class DnsFleetTest(unittest.TestCase):
    """Three servers behind one name and port; a fourth joins."""

    def setUp(self):
        self.config = write_config()
        self.servers = []
        for _ in range(8):
            port = free_port()
            try:
                for i in (2, 3, 4):
                    self.servers.append(start("127.0.0.%d" % i, "mlakv-%d" % i, self.config, port))
                self.port = port
                break
            except RuntimeError:  # the port was taken meanwhile on one address
                stop_all(self.servers)
                self.servers = []
        self.assertEqual(len(self.servers), 3)
        self.ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        self.lock = threading.Lock()

    def tearDown(self):
        stop_all(self.servers)
        os.unlink(self.config)

    def resolver(self, name):
        self.assertEqual(name, "mlakv.kv.svc.cluster.local")
        with self.lock:
            return list(self.ips)

    def test_a_fourth_server_takes_a_quarter_of_new_sequences_and_moves_none(self):
        service = "dns:///mlakv.kv.svc.cluster.local:%d" % self.port
        with mlakv.Fleet(service=service, resolver=self.resolver, refresh_interval=0, timeout=30) as fleet:
            self.assertEqual(len(fleet.servers()), 3)
            old = {}
            for i in range(1000):
                sid = "old-%d" % i
                fleet.append(sid, layer=0, ckv=CKV, kpe=KPE, start=0, pool="p")
                old[sid] = fleet.owner_of(sid)
            self.servers.append(start("127.0.0.5", "mlakv-5", self.config, self.port))
            with self.lock:
                self.ips.append("127.0.0.5")
            fleet.refresh()
            self.assertEqual([s[2] for s in fleet.servers()], [True] * 4)
            to_new = 0
            for i in range(2000):
                sid = "new-%d" % i
                fleet.append(sid, layer=0, ckv=CKV, kpe=KPE, start=0, pool="p")
                to_new += fleet.owner_of(sid) == "mlakv-5"
            self.assertLess(abs(to_new - 500), 75, "%d of 2000 new sequences went to the fourth" % to_new)
            listed = fleet.sequences("p").answers
            self.assertFalse(any(s.id.startswith("old-") for s in listed["mlakv-5"]))
            for sid, owner in old.items():
                self.assertEqual(fleet.sequence(sid, pool="p").server_id, owner)
            # The name drops the fourth: it is dropped with what was recorded on it.
            with self.lock:
                self.ips.remove("127.0.0.5")
            fleet.refresh()
            self.assertEqual(len(fleet.servers()), 3)
            self.assertFalse(any(fleet.owner_of("new-%d" % i) == "mlakv-5" for i in range(2000)))


if __name__ == "__main__":
    unittest.main()
