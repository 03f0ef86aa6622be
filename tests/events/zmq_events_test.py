"""KV events on ZeroMQ in vLLM's format, decoded by a real subscriber.

A real mlakv-server process publishes with --kv_events_endpoint and
--kv_events_replay_endpoint; this test subscribes with pyzmq (Debian
python3-zmq), decodes every batch with msgpack (python3-msgpack) as vLLM's
KVEventBatch is laid out (msgspec's array-like encoding: [ts, [event...]],
each event [tag, fields...]), runs a known workload over gRPC and checks:

* the first event is AllBlocksCleared (the server started empty);
* BlockStored hashes are exactly the workload's complete pages, each once,
  with its parent hash, block size and medium; BlockRemoved exactly the
  freed ones;
* batch sequence numbers have no gaps, and a replay request from 0 returns
  every batch published, byte for byte, then the end marker (-1);
* a subscriber that joins late gets what it missed through replay.

Run by ctest (label `events`) with MLAKV_SERVER, MLAKV_PY_GEN and PYTHONPATH set.
"""

import os
import sys
import tempfile
import time
import unittest

import grpc
import msgpack
import zmq

import mlakv  # noqa: F401  (puts the generated stubs on the path)
from mlakv.v1 import kv_cache_pb2 as pb
from mlakv.v1 import kv_cache_pb2_grpc as pbg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python", "tests"))
from server_process import ServerProcess  # noqa: E402

BF16_ONE = b"\x80\x3f"
PAGE = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode(payload):
    ts, events = msgpack.unpackb(payload, raw=False)
    return ts, events


class ZmqEventsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.config = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
        cls.config.write("pools { name: 'default' num_layers: 2 page_size: %d num_pages: 256 }" % PAGE)
        cls.config.close()
        cls.server = ServerProcess(
            "--config", cls.config.name,
            "--kv_events_endpoint", "tcp://127.0.0.1:*",
            "--kv_events_replay_endpoint", "tcp://127.0.0.1:*",
            "--kv_events_topic", "kv@test", "--server_id", "events-test").start()
        # The ports ZeroMQ picked, from the start-up line (no pick-then-bind race).
        cls.pub_endpoint, cls.replay_endpoint = cls.server.kv_events_endpoints()
        cls.channel = grpc.insecure_channel(cls.server.target)
        cls.stub = pbg.KvCacheStub(cls.channel)
        cls.ctx = zmq.Context()

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()
        cls.ctx.term()
        os.unlink(cls.config.name)

    def subscriber(self):
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
        sub.connect(self.pub_endpoint)
        return sub

    def replay(self, start):
        """Every batch the server kept from `start`, as (seq, payload), up to the end marker."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        poller = zmq.Poller()
        poller.register(req, zmq.POLLIN)
        while True:
            self.assertTrue(poller.poll(5000), "no replay answer within 5 s")
            _, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                break
            out.append((int.from_bytes(seq, "big"), payload))
        req.close()
        return out

    def append(self, sequence, start, pages, hashes, first_hash=0):
        n = pages * PAGE
        m = pb.AppendRequest(sequence=sequence, start=start, row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16,
                             block_hashes=hashes, block_hashes_first_page=first_hash)
        for layer in (0, 1):
            m.layers.add(layer=layer, ckv=BF16_ONE * 512 * n, kpe=BF16_ONE * 64 * n, ckv_scale=1.0, kpe_scale=1.0)
        self.stub.Append(iter([m]), timeout=10)

    def test_a_known_workload_in_vllms_schema(self):
        sub = self.subscriber()
        time.sleep(0.3)  # the slow joiner: replay covers what it misses anyway
        # 10 sequences x 3 complete pages (+ half a page), hashes h<seq>-<page>; free the even ones.
        stored_expected, removed_expected = [], []
        for s in range(10):
            hashes = [b"h%d-%d" % (s, p) for p in range(3)]
            self.append("s%d" % s, 0, 3, hashes)
            stored_expected += hashes
            m = pb.AppendRequest(sequence="s%d" % s, start=3 * PAGE, row_count=2, dtype=pb.ROW_DTYPE_BFLOAT16)
            for layer in (0, 1):
                m.layers.add(layer=layer, ckv=BF16_ONE * 512 * 2, kpe=BF16_ONE * 64 * 2)
            self.stub.Append(iter([m]), timeout=10)  # a partial page: no event
        for s in range(0, 10, 2):
            self.stub.FreeSequence(pb.FreeSequenceRequest(sequence="s%d" % s), timeout=10)
            removed_expected += [b"h%d-%d" % (s, p) for p in range(3)]
        # Everything published, by replay from 0 (the first batch predates the subscriber).
        deadline = time.monotonic() + 10
        while True:
            batches = self.replay(0)
            events = [e for _, payload in batches for e in decode(payload)[1]]
            removed = sum(len(e[1]) for e in events if e[0] == "BlockRemoved")
            if removed >= len(removed_expected) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        seqs = [seq for seq, _ in batches]
        self.assertEqual(seqs, list(range(len(seqs))), "batch numbers without gaps, from 0")
        self.assertEqual(events[0], ["AllBlocksCleared"])
        stored = [e for e in events if e[0] == "BlockStored"]
        removed = [e for e in events if e[0] == "BlockRemoved"]
        self.assertEqual([h for e in stored for h in e[1]], stored_expected)
        self.assertEqual(sorted(h for e in removed for h in e[1]), sorted(removed_expected))
        for e in stored:
            self.assertEqual(len(e), 7, e)
            _, hashes, parent, token_ids, block_size, lora_id, medium = e
            self.assertIsNone(parent, "each sequence's pages are stored from its first page")
            self.assertEqual(token_ids, [])
            self.assertEqual(block_size, PAGE)
            self.assertIsNone(lora_id)
            self.assertEqual(medium, "CPU")
        for e in removed:
            self.assertEqual(len(e), 3, e)
            self.assertEqual(e[2], "CPU")
        # The live subscriber got the same batches, byte for byte, from the
        # first one it saw on.
        live = []
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            self.assertEqual(topic, b"kv@test")
            live.append((int.from_bytes(seq, "big"), payload))
        self.assertTrue(live, "the subscriber received batches")
        by_seq = dict(batches)
        for seq, payload in live:
            self.assertEqual(by_seq[seq], payload)
        self.assertEqual([s for s, _ in live], list(range(live[0][0], live[0][0] + len(live))))
        sub.close()

    def test_a_page_completed_later_names_its_parent(self):
        self.append("chain", 0, 1, [b"c0"])
        self.append("chain", PAGE, 1, [b"c1"], first_hash=1)
        deadline = time.monotonic() + 5
        while True:
            events = [e for _, p in self.replay(0) for e in decode(p)[1]]
            chain = [e for e in events if e[0] == "BlockStored" and e[1] and e[1][0] in (b"c0", b"c1")]
            if len(chain) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.assertEqual(len(chain), 2)
        self.assertEqual(chain[1][1], [b"c1"])
        self.assertEqual(chain[1][2], b"c0", "parent_block_hash links the chain")

    def test_the_configured_replay_bound_is_what_a_replay_returns(self):
        # A second server whose replay keeps 3 batches (events.zmq_replay_batches).
        with tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False) as config:
            config.write("pools { name: 'default' num_layers: 2 page_size: %d num_pages: 64 } "
                         "events { zmq_replay_batches: 3 }" % PAGE)
        server = ServerProcess("--config", config.name,
                               "--kv_events_endpoint", "tcp://127.0.0.1:*",
                               "--kv_events_replay_endpoint", "tcp://127.0.0.1:*").start()
        try:
            pub_endpoint, replay_endpoint = server.kv_events_endpoints()
            channel = grpc.insecure_channel(server.target)
            stub = pbg.KvCacheStub(channel)
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub_endpoint)

            def append_page(sequence):  # one full page: one batch with one BlockStored
                n = PAGE
                m = pb.AppendRequest(sequence=sequence, start=0, row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16,
                                     block_hashes=[sequence.encode()])
                for layer in (0, 1):
                    m.layers.add(layer=layer, ckv=BF16_ONE * 512 * n, kpe=BF16_ONE * 64 * n, ckv_scale=1.0, kpe_scale=1.0)
                stub.Append(iter([m]), timeout=10)

            # The slow joiner: a batch published before the subscription
            # reached the server is dropped for this subscriber, so warm-up
            # batches go out until one arrives (earlier than b0..b5: the
            # replay's last 3 are still b3..b5).
            joined = False
            for w in range(100):
                append_page("warm-%d" % w)
                if sub.poll(100):
                    sub.recv_multipart()
                    joined = True
                    break
            self.assertTrue(joined, "no batch reached the subscriber in 100 tries")
            while sub.poll(100):  # the warm-ups' batches still on their way
                sub.recv_multipart()
            newest = -1
            for s in range(6):  # one batch each: the next waits for it
                append_page("b%d" % s)
                deadline = time.monotonic() + 5
                got = False
                while not got and time.monotonic() < deadline:
                    if sub.poll(100):
                        _, seq, payload = sub.recv_multipart()
                        newest = int.from_bytes(seq, "big")
                        got = any(e[0] == "BlockStored" and e[1] == [b"b%d" % s] for e in decode(payload)[1])
                self.assertTrue(got, "batch of b%d not seen" % s)
            req = self.ctx.socket(zmq.DEALER)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(replay_endpoint)
            req.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                self.assertTrue(req.poll(5000), "no replay answer within 5 s")
                _, seq, _payload = req.recv_multipart()
                if seq == END_SEQ:
                    break
                seqs.append(int.from_bytes(seq, "big"))
            req.close()
            sub.close()
            channel.close()
            self.assertGreaterEqual(newest, 5)
            self.assertEqual(seqs, [newest - 2, newest - 1, newest], "the last 3 batches, no more")
        finally:
            server.stop()
            os.unlink(config.name)

    def test_a_bad_endpoint_fails_start_up_naming_the_flag(self):
        bad = ServerProcess("--kv_events_endpoint", "tcp://256.1.1.1:1")
        with self.assertRaises(RuntimeError) as err:
            bad.start()
        self.assertIn("--kv_events_endpoint", str(err.exception) + bad.log_text())

    def test_a_send_queue_past_its_limit_fails_start_up_naming_it(self):
        with tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False) as config:
            config.write("pools { name: 'default' num_layers: 2 page_size: 4 num_pages: 64 } "
                         "events { zmq_send_queue: 100001 }")
        try:
            bad = ServerProcess("--config", config.name, "--kv_events_endpoint", "tcp://127.0.0.1:*")
            with self.assertRaises(RuntimeError) as err:
                bad.start()
            text = str(err.exception) + bad.log_text()
            self.assertIn("events.zmq_send_queue 100001 exceeds 100000", text)
        finally:
            os.unlink(config.name)


if __name__ == "__main__":
    unittest.main()
