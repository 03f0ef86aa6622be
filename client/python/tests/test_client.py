"""The Python client against a real mlakv-server process on a loopback port.

Run by ctest (python_client) with /usr/bin/python3 and the environment
MLAKV_SERVER (server binary), MLAKV_PY_GEN (generated stubs),
MLAKV_VECTORS_DIR_DEFAULT (../shared/vectors; MLAKV_VECTORS_DIR wins), PYTHONPATH=client/python.
"""

import glob
import os
import unittest

import grpc
import numpy as np

import mlakv
from mlakv import safetensors
from server_process import ServerProcess
from server_test_case import CALL_TIMEOUT_S, ServerTestCase, random_rows

# ../shared/vectors beside the project; MLAKV_VECTORS_DIR in the environment wins (as for the C++ tests).
VECTORS_DIR = (os.environ.get("MLAKV_VECTORS_DIR") or os.environ.get("MLAKV_VECTORS_DIR_DEFAULT")
               or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "shared", "vectors"))


class VectorRoundTripTest(ServerTestCase):
    """Every ../shared/vectors file through append -> export, byte for byte."""

    def test_vectors_byte_exact(self):
        files = sorted(glob.glob(os.path.join(VECTORS_DIR, "*.safetensors")))
        self.assertGreaterEqual(len(files), 8, "no vectors in " + VECTORS_DIR)
        for layer, path in enumerate(files):  # one layer per file: scales are fixed per layer
            name = os.path.basename(path)
            with self.subTest(vector=name):
                t = safetensors.load(path)
                seq = "vec-" + name
                ckv_scale, kpe_scale = float(t["ckv_scale"][0]), float(t["kpe_scale"][0])
                resp = self.client.append(seq, layer, t["ckv"], t["kpe"],
                                          ckv_scale=ckv_scale, kpe_scale=kpe_scale)
                n = t["ckv"].shape[0]
                self.assertEqual(resp.rows_written, n)
                self.assertEqual(resp.sequence.layer_lengths[layer], n)
                got = self.client.export(seq, layer)
                self.assertEqual(got["ckv_packed"].shape, (n, 256))
                self.assertEqual(got["ckv_sf"].shape, (n, 32))
                self.assertEqual(got["kpe"].shape, (n, 64))
                np.testing.assert_array_equal(got["ckv_packed"], t["expect_ckv_packed"])
                np.testing.assert_array_equal(got["ckv_sf"], t["expect_ckv_sf"])
                np.testing.assert_array_equal(got["kpe"], t["expect_kpe"])
                self.assertEqual(np.float32(got["ckv_scale"]), t["ckv_scale"][0])
                self.assertEqual(np.float32(got["kpe_scale"]), t["kpe_scale"][0])
                self.assertGreater(self.client.free(seq), 0)

    def test_read_dequantized_matches_stored_bytes(self):
        t = safetensors.load(os.path.join(VECTORS_DIR, "bf16_calibrated.safetensors"))
        layer = 20
        ckv_scale, kpe_scale = float(t["ckv_scale"][0]), float(t["kpe_scale"][0])
        self.client.append("deq", layer, t["ckv"], t["kpe"], ckv_scale=ckv_scale, kpe_scale=kpe_scale)
        got = self.client.read_dequantized("deq", layer)
        n = t["ckv"].shape[0]
        self.assertEqual(got["ckv"].dtype, np.float32)
        self.assertEqual(got["ckv"].shape, (n, 512))
        self.assertEqual(got["kpe"].shape, (n, 64))
        # Decoding (docs/format.md): ckv = e2m1 * e4m3(block scale) * ckv_scale; kpe = e4m3 * kpe_scale.
        ckv = decode_ckv(t["expect_ckv_packed"], t["expect_ckv_sf"], np.float32(ckv_scale))
        kpe = e4m3_to_float(t["expect_kpe"]) * np.float32(kpe_scale)
        np.testing.assert_array_equal(got["ckv"], ckv)
        np.testing.assert_array_equal(got["kpe"], kpe)
        self.client.free("deq")

    def test_export_token_range(self):
        t = safetensors.load(os.path.join(VECTORS_DIR, "f16_calibrated.safetensors"))
        layer = 21
        self.client.append("range", layer, t["ckv"], t["kpe"],
                           ckv_scale=float(t["ckv_scale"][0]), kpe_scale=float(t["kpe_scale"][0]))
        got = self.client.export("range", layer, start=5, count=17, tokens_per_message=4)
        np.testing.assert_array_equal(got["ckv_packed"], t["expect_ckv_packed"][5:22])
        np.testing.assert_array_equal(got["ckv_sf"], t["expect_ckv_sf"][5:22])
        np.testing.assert_array_equal(got["kpe"], t["expect_kpe"][5:22])
        self.client.free("range")


def e4m3_to_float(b):
    """E4M3 (fn) bytes -> float32, exactly."""
    b = b.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0).astype(np.float32)
    exp = (b >> 3) & 0xF
    man = (b & 7).astype(np.float32)
    normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float32) - 7.0)
    sub = (man / 8.0) * np.float32(2.0 ** -6)
    val = np.where(exp == 0, sub, normal).astype(np.float32)
    val = np.where((b & 0x7F) == 0x7F, np.float32(np.nan), val)
    return sign * val


E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def decode_ckv(packed, sf, ckv_scale):
    """Packed E2M1 [T,256] + E4M3 block scales [T,32] -> float32 [T,512] (e2m1 * s, then * ckv_scale)."""
    lo, hi = packed & 0xF, packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], 512)
    e2m1 = E2M1_VALUES[codes]
    s = np.repeat(e4m3_to_float(sf), 16, axis=1)
    return (e2m1 * s).astype(np.float32) * ckv_scale


class QueryTest(ServerTestCase):
    def test_health_serving(self):
        self.assertEqual(self.client.health(), "SERVING")

    def test_pools(self):
        pools = self.client.pools()
        self.assertGreaterEqual(len(pools), 1)
        default = self.client.pool()
        self.assertIn(default.name, [p.name for p in pools])
        self.assertEqual(default.device, "cpu")
        self.assertEqual(default.ckv_dim, 512)
        self.assertEqual(default.kpe_dim, 64)
        self.assertEqual(default.bytes_per_token_per_layer, 352)
        self.assertEqual(default.num_layers, 61)
        self.assertEqual(default.pages_free + default.pages_used, default.pages_total)
        self.assertEqual(self.client.pool(default.name).name, default.name)

    def test_sequence_page_table_truncate_free(self):
        rng = np.random.default_rng(1)
        pool = self.client.pool()
        ps = pool.page_size
        n = 2 * ps + 3
        ckv, kpe = random_rows(rng, n, "f16")
        self.client.append("q-seq", 0, ckv, kpe, ckv_scale=0.01, kpe_scale=0.05)
        self.client.append("q-seq", 1, ckv, kpe, ckv_scale=0.01, kpe_scale=0.05)
        seq = self.client.sequence("q-seq")
        self.assertEqual(seq.id, "q-seq")
        self.assertEqual(list(seq.layer_lengths[:2]), [n, n])
        self.assertEqual(len(seq.kv_indices), 3)
        self.assertEqual(seq.page_size, ps)
        page = self.client.page(seq.kv_indices[1])
        self.assertTrue(page.used)
        self.assertEqual(page.sequence, "q-seq")
        self.assertEqual(page.page_index, 1)
        self.assertEqual(page.first_position, ps)
        self.assertEqual(list(page.filled_per_layer[:2]), [ps, ps])
        self.assertEqual(list(page.layers_written), [0, 1])
        seq = self.client.truncate("q-seq", ps)
        self.assertEqual(list(seq.layer_lengths[:2]), [ps, ps])
        self.assertEqual(len(seq.kv_indices), 1)
        self.assertEqual(self.client.free("q-seq"), 1)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "q-seq")
        after = self.client.pool()
        self.assertEqual(after.pages_free, after.pages_total - after.pages_used)

    def test_sequences_paginated(self):
        rng = np.random.default_rng(2)
        ckv, kpe = random_rows(rng, 1, "f16")
        ids = ["list-%d" % i for i in range(5)]
        for i in ids:
            self.client.append(i, 2, ckv, kpe, ckv_scale=0.01, kpe_scale=0.05)
        listed = [s.id for s in self.client.sequences(page_size=2) if s.id.startswith("list-")]
        self.assertEqual(listed, ids)
        for i in ids:
            self.client.free(i)
        self.assertEqual([s.id for s in self.client.sequences() if s.id.startswith("list-")], [])

    def test_start_none_appends_at_layer_length(self):
        rng = np.random.default_rng(3)
        a_ckv, a_kpe = random_rows(rng, 10)
        b_ckv, b_kpe = random_rows(rng, 7)
        self.client.append("cont", 3, a_ckv, a_kpe, ckv_scale=0.01, kpe_scale=0.05)
        resp = self.client.append("cont", 3, b_ckv, b_kpe)  # start=None -> 10
        self.assertEqual(resp.sequence.layer_lengths[3], 17)
        # Same rows in one call elsewhere: identical bytes.
        self.client.append("whole", 3, np.concatenate([a_ckv, b_ckv]), np.concatenate([a_kpe, b_kpe]))
        self.assert_same_bytes(self.client.export("cont", 3), self.client.export("whole", 3))
        self.client.free("cont")
        self.client.free("whole")

    def assert_same_bytes(self, a, b):
        for k in ("ckv_packed", "ckv_sf", "kpe"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class ChunkingTest(ServerTestCase):
    """Large appends travel as ~4 MB messages of one Append stream."""

    def count_messages(self, client):
        sizes = []
        real = client._stub.Append

        def spy(requests, **kwargs):
            msgs = list(requests)
            sizes.extend(m.ByteSize() for m in msgs)
            self.starts.extend(m.start for m in msgs)
            return real(iter(msgs), **kwargs)

        client._stub.Append = spy
        self.starts = []
        return sizes

    def test_large_append_is_chunked_and_byte_equal(self):
        rng = np.random.default_rng(4)
        n = 10000  # 10000 x 1152 bytes = 11.5 MB of bf16 rows -> 3 messages of <= 4 MiB
        ckv, kpe = random_rows(rng, n)
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S) as c:
            sizes = self.count_messages(c)
            resp = c.append("big", 0, ckv, kpe, ckv_scale=0.01, kpe_scale=0.05)
        per = ((4 << 20) - 1024) // 1152  # 3640 rows: 4193280 bytes of rows
        self.assertEqual(len(sizes), 3)
        self.assertEqual(self.starts, [0, per, 2 * per])
        for s in sizes:
            self.assertLessEqual(s, 4 << 20)
        self.assertEqual(resp.rows_written, n)
        self.assertEqual(resp.sequence.layer_lengths[0], n)
        a = self.client.export("big", 0)
        self.assertEqual(a["kpe"].shape, (n, 64))
        self.client.free("big")  # the default pool (256 pages of 64) holds one such sequence at a time
        # The same rows in many small messages store the same bytes.
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, chunk_bytes=100 * 1152 + 1024) as c:
            sizes = self.count_messages(c)
            c.append("small-chunks", 0, ckv, kpe)
        self.assertEqual(len(sizes), 100)
        b = self.client.export("small-chunks", 0)
        for k in ("ckv_packed", "ckv_sf", "kpe"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        self.client.free("small-chunks")

    def test_multi_layer_append(self):
        rng = np.random.default_rng(5)
        ckv, kpe = random_rows(rng, 3 * 50, "f16")
        ckv, kpe = ckv.reshape(3, 50, 512), kpe.reshape(3, 50, 64)
        resp = self.client.append("ml", [4, 5, 6], ckv, kpe, ckv_scale=0.01, kpe_scale=0.05)
        self.assertEqual(resp.rows_written, 150)
        self.assertEqual(list(resp.sequence.layer_lengths[4:7]), [50, 50, 50])
        for i, layer in enumerate([4, 5, 6]):
            self.client.append("ml-ref-%d" % layer, layer, ckv[i], kpe[i])
            a, b = self.client.export("ml", layer), self.client.export("ml-ref-%d" % layer, layer)
            np.testing.assert_array_equal(a["ckv_packed"], b["ckv_packed"])
            np.testing.assert_array_equal(a["kpe"], b["kpe"])


class AppendBatchTest(ServerTestCase):
    def test_decode_step(self):
        rng = np.random.default_rng(6)
        seqs = ["dec-%d" % i for i in range(4)]
        layers = [0, 1, 2]
        steps = []
        for step in range(3):
            items = []
            rows = {}
            for s in seqs:
                per_layer = {l: random_rows(rng, 1) for l in layers}
                rows[s] = per_layer
                items.append(mlakv.SequenceRows(s, per_layer))  # start=None: current length
            resp = self.client.append_batch(items, ckv_scale=0.01, kpe_scale=0.05)
            steps.append(rows)
            self.assertEqual(resp.rows_written, len(seqs) * len(layers))
            self.assertEqual([q.id for q in resp.sequences], seqs)
            for q in resp.sequences:
                self.assertEqual(list(q.layer_lengths[:3]), [step + 1] * 3)
                self.assertEqual(q.length, 0)  # min over all 61 layers; only 3 are written
        # Same rows appended one sequence/layer at a time store the same bytes.
        for s in seqs:
            for l in layers:
                ckv = np.concatenate([steps[k][s][l][0] for k in range(3)])
                kpe = np.concatenate([steps[k][s][l][1] for k in range(3)])
                self.client.append("ref-" + s, l, ckv, kpe, start=0)
                a, b = self.client.export(s, l), self.client.export("ref-" + s, l)
                for k in ("ckv_packed", "ckv_sf", "kpe"):
                    np.testing.assert_array_equal(a[k], b[k], err_msg="%s layer %d %s" % (s, l, k))
        for s in seqs:
            self.client.free(s)
            self.client.free("ref-" + s)

    def test_tuple_items_and_explicit_start(self):
        rng = np.random.default_rng(7)
        r = random_rows(rng, 2, "f16")
        resp = self.client.append_batch([("tup-a", {7: r}, 0), ("tup-b", {7: r})],
                                        ckv_scale=0.01, kpe_scale=0.05)
        self.assertEqual([q.layer_lengths[7] for q in resp.sequences], [2, 2])
        self.client.free("tup-a")
        self.client.free("tup-b")

    def test_decode_step_compact_form_stores_what_per_sequence_appends_store(self):
        rng = np.random.default_rng(61)
        seqs = ["cstep-%d" % i for i in range(5)]
        layers = [0, 3, 9]
        written = {s: {l: [] for l in layers} for s in seqs}  # (ckv, kpe) parts in position order
        # One sequence already holds 2 tokens: starts=None must put the step after them.
        for l in layers:
            rows = random_rows(rng, 2)
            self.client.append(seqs[1], l, *rows, start=0, ckv_scale=0.01, kpe_scale=0.05)
            written[seqs[1]][l].append(rows)
        lengths = [0, 2, 0, 0, 0]
        for counts in (None, [1, 2, 1, 3, 1]):
            n = [1] * len(seqs) if counts is None else counts
            ckv = np.empty((len(layers), sum(n), 512), np.uint16)
            kpe = np.empty((len(layers), sum(n), 64), np.uint16)
            for i in range(len(layers)):
                ckv[i], kpe[i] = random_rows(rng, sum(n))
            resp = self.client.decode_step(seqs, ckv, kpe, layers=layers, row_counts=counts,
                                           ckv_scale=0.01, kpe_scale=0.05)
            self.assertEqual(resp.rows_written, sum(n) * len(layers))
            lengths = [a + b for a, b in zip(lengths, n)]
            # The default view is compact: request order, no names, no per-layer lengths.
            self.assertEqual([(q.id, q.pool, q.server_id) for q in resp.sequences], [("", "", "")] * len(seqs))
            self.assertTrue(all(len(q.layer_lengths) == 0 for q in resp.sequences))
            stored = [self.client.sequence(s).layer_lengths for s in seqs]
            self.assertEqual([[x[l] for l in layers] for x in stored], [[e] * len(layers) for e in lengths])
            # Rows [edges[k], edges[k + 1]) of each layer are sequence k's.
            edges = np.cumsum([0] + n)
            for k, s in enumerate(seqs):
                for i, l in enumerate(layers):
                    written[s][l].append((ckv[i, edges[k]:edges[k + 1]], kpe[i, edges[k]:edges[k + 1]]))
        for s in seqs:
            for l in layers:
                parts = written[s][l]
                self.client.append("cref", l, np.concatenate([p[0] for p in parts]),
                                   np.concatenate([p[1] for p in parts]), start=0, ckv_scale=0.01, kpe_scale=0.05)
                a, b = self.client.export(s, l), self.client.export("cref", l)
                for f in ("ckv_packed", "ckv_sf", "kpe"):
                    np.testing.assert_array_equal(a[f], b[f], err_msg="%s layer %d %s" % (s, l, f))
                self.client.free("cref")
        for s in seqs:
            self.client.free(s)

    def test_decode_step_refusals_write_nothing(self):
        rng = np.random.default_rng(62)
        ckv, kpe = (np.stack(x) for x in zip(*[random_rows(rng, 3) for _ in range(2)]))
        cases = [
            (dict(sequences=["r-a", "r-b"]), "row_counts sum to 2"),  # 3 rows per layer for 2 sequences
            (dict(sequences=["r-a", "r-b"], row_counts=[1, 1, 1]), "row_counts must give"),
            (dict(sequences=["r-a", "r-b", "r-c"], starts=[0, 0]), "2 starts for 3 sequences"),
            (dict(sequences=["r-a", "r-b", "r-c"], layers=[0]), "1 layer indices for 2 layers"),
            (dict(sequences=["r-a", "r-b", "r-c"], view="tiny"), "view 'tiny' is not one of"),
            (dict(sequences=[]), "no sequence given"),
        ]
        for kwargs, text in cases:
            e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.decode_step, ckv=ckv, kpe=kpe, **kwargs)
            self.assertIn(text, e.message)
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.decode_step, ["r-a"], ckv[0], kpe[0])
        self.assertIn("[layers, rows, 512]", e.message)
        # Refused by the server (a sequence named twice): nothing of the step is written.
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.decode_step, ["r-a", "r-b", "r-a"],
                            ckv, kpe, starts=[0, 0, 0], ckv_scale=0.01, kpe_scale=0.05)
        self.assertIn("twice", e.message)
        for s in ("r-a", "r-b", "r-c"):
            self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, s)

    def test_views(self):
        rng = np.random.default_rng(63)
        rows = random_rows(rng, 70)  # two pages of 64
        full = self.client.append("v-full", 0, *rows, ckv_scale=0.01, kpe_scale=0.05)
        self.assertEqual((full.sequence.id, len(full.sequence.layer_lengths)), ("v-full", 61))
        basic = self.client.append("v-full", 0, *random_rows(rng, 60), view="basic")
        # basic: only the page this call allocated (the table's entry 1 was already there: 70 + 60 = 130 -> 3 pages).
        self.assertEqual((basic.sequence.id, len(basic.sequence.layer_lengths)), ("v-full", 0))
        self.assertEqual((basic.sequence.kv_indices_offset, len(basic.sequence.kv_indices)), (2, 1))
        compact = self.client.append("v-full", 0, *random_rows(rng, 1), view="COMPACT")
        self.assertEqual((compact.sequence.id, compact.sequence.pool, compact.sequence.kv_indices_offset,
                          len(compact.sequence.kv_indices)), ("", "", 3, 0))
        table = list(self.client.sequence("v-full").kv_indices)
        self.assertEqual(table[2:3], list(basic.sequence.kv_indices))
        batch = self.client.append_batch([("v-full", {0: random_rows(rng, 1)}), ("v-new", {0: random_rows(rng, 1)})],
                                         view="compact")
        # v-full's step fits its last page (no new page); v-new's allocates its first.
        self.assertEqual([(q.id, q.length, len(q.kv_indices)) for q in batch.sequences], [("", 0, 0), ("", 0, 1)])
        # packed: the same numbers in parallel arrays, no Sequence messages.
        packed = self.client.append_batch([("v-full", {0: random_rows(rng, 1)}), ("v-new2", {0: random_rows(rng, 1)})],
                                          view="packed")
        self.assertEqual(len(packed.sequences), 0)
        self.assertEqual((list(packed.packed.new_page_counts), list(packed.packed.kv_indices_offsets)), ([0, 1], [3, 0]))
        self.assertEqual(list(packed.packed.new_pages), list(self.client.sequence("v-new2").kv_indices))
        self.assertEqual(len(packed.packed.generations), 2)
        with self.client.save("v-saved", view="basic", layerwise_min_tokens=0) as s:
            s.layer(0, *random_rows(rng, 5))
        saved = s.wait().sequence
        self.assertEqual((saved.id, len(saved.layer_lengths), len(saved.kv_indices)), ("v-saved", 0, 1))
        # lengths: no names, no page ids; kv_indices_offset is the pages held.
        with self.client.save("v-lengths", view="lengths", layerwise_min_tokens=0) as s:
            s.layer(0, *random_rows(rng, 70))
        held = s.wait().sequence
        self.assertEqual((held.id, len(held.kv_indices), held.kv_indices_offset, held.capacity_tokens), ("", 0, 2, 128))
        self.assertEqual(len(self.client.sequence("v-lengths").kv_indices), 2)
        for call in (lambda: self.client.append("v-full", 0, *random_rows(rng, 1), view=2),
                     lambda: self.client.append_batch([("v-full", {0: random_rows(rng, 1)})], view="all"),
                     lambda: self.client.save("v-x", view="none")):
            e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, call)
            self.assertIn("is not one of", e.message)
        self.assertEqual(self.client.sequence("v-full").layer_lengths[0], 133)  # the refused calls wrote nothing
        for s in ("v-full", "v-new", "v-saved", "v-lengths"):
            self.client.free(s)

    def test_mixed_dtypes_refused_by_client(self):
        rng = np.random.default_rng(8)
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append_batch,
                            [("mix-a", {0: random_rows(rng, 1, "f16")}), ("mix-b", {0: random_rows(rng, 1, "bf16")})])
        self.assertIn("one dtype per batch", e.message)


class ErrorTest(ServerTestCase):
    """Server errors arrive as mlakv.Error with the status code and the server's message."""

    def rows(self, n=4, dtype="bf16"):
        return random_rows(np.random.default_rng(9), n, dtype)

    def test_unknown_sequence_not_found(self):
        e = self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "no-such-sequence")
        self.assertIn("no-such-sequence", e.message)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.free, "no-such-sequence")
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.export, "no-such-sequence", 0)

    def test_unknown_pool_not_found(self):
        e = self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.pool, "no-such-pool")
        self.assertIn("no-such-pool", e.message)

    def test_bad_scale_invalid_argument(self):
        ckv, kpe = self.rows()
        for bad in (-1.0, float("nan"), float("inf"), 1e-40):
            with self.subTest(scale=bad):
                self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append, "bad-scale", 30, ckv, kpe,
                                ckv_scale=bad, kpe_scale=1.0)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "bad-scale")

    def test_scale_mismatch_failed_precondition(self):
        ckv, kpe = self.rows()
        self.client.append("scales", 31, ckv, kpe, ckv_scale=0.5, kpe_scale=0.5)
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.append, "scales", 31, ckv, kpe,
                        ckv_scale=0.25, kpe_scale=0.5)
        self.assertEqual(self.client.sequence("scales").layer_lengths[31], 4)
        self.client.free("scales")

    def test_hole_refused(self):
        ckv, kpe = self.rows()
        e = self.assertCode(HOLE_CODE, self.client.append, "hole", 32, ckv, kpe, start=5, ckv_scale=1, kpe_scale=1)
        self.assertIn("5", e.message)

    def test_layer_out_of_range(self):
        ckv, kpe = self.rows()
        self.assertCode(LAYER_CODE, self.client.append, "layer", 61, ckv, kpe, ckv_scale=1, kpe_scale=1)

    def test_wrong_byte_count_from_server(self):
        # The client checks shapes, so talk to the stub directly to reach the server's check.
        req = mlakv.pb.AppendRequest(sequence="bytes", row_count=4, dtype=mlakv.pb.ROW_DTYPE_BFLOAT16)
        req.layers.add(layer=0, ckv=b"\0" * 4000, kpe=b"\0" * 512, ckv_scale=1.0, kpe_scale=1.0)
        try:
            self.client._stub.Append(iter([req]), timeout=CALL_TIMEOUT_S)
            self.fail("Append with 4000 ckv bytes for 4 bf16 rows (4096 expected) succeeded")
        except grpc.RpcError as err:
            e = mlakv.Error.from_rpc_error(err)
        self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.assertIn("4000", e.message)
        self.assertIn("rows(4)", e.message)

    def test_client_side_checks(self):
        ckv, kpe = self.rows()
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append, "c", 0,
                            ckv.astype(np.float32), kpe)
        self.assertTrue(e.message.startswith("client: "), e.message)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append, "c", 0, ckv[:, :256], kpe)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append, "c", 0, ckv, kpe[:3])
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append, "c", 0,
                        ckv.view(np.float16), kpe)  # f16 ckv with bf16 kpe
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append, "c", 0, ckv.tolist(), kpe)

    def test_unavailable_when_nothing_listens(self):
        with mlakv.Client("127.0.0.1:1", timeout=5) as c:
            self.assertCode(grpc.StatusCode.UNAVAILABLE, c.pools)


# Codes the server chose where DESIGN.md allows two (asserted exactly, so a change is noticed).
HOLE_CODE = grpc.StatusCode.OUT_OF_RANGE
LAYER_CODE = grpc.StatusCode.OUT_OF_RANGE


class SmallPoolTest(ServerTestCase):
    """A configured second pool: pool= on every call, and RESOURCE_EXHAUSTED writing nothing."""

    @classmethod
    def setUpClass(cls):
        import tempfile
        cls.config = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
        cls.config.write('pools { name: "default" num_layers: 61 page_size: 64 num_pages: 64 }\n'
                         'pools { name: "tiny" num_layers: 2 page_size: 16 num_pages: 4 }\n')
        cls.config.close()
        cls.server_args = ("--config", cls.config.name)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        os.unlink(cls.config.name)

    def test_pools_listed(self):
        pools = {p.name: p for p in self.client.pools()}
        self.assertEqual(sorted(pools), ["default", "tiny"])
        tiny = self.client.pool("tiny")
        self.assertEqual((tiny.num_layers, tiny.page_size, tiny.pages_total, tiny.device), (2, 16, 4, "cpu"))

    def test_pool_full_writes_nothing(self):
        rng = np.random.default_rng(12)
        ckv, kpe = random_rows(rng, 40)
        self.client.append("fill", 0, ckv, kpe, pool="tiny", ckv_scale=0.01, kpe_scale=0.05)  # 3 of 4 pages
        before = self.client.pool("tiny")
        self.assertEqual(before.pages_free, 1)
        more, more_kpe = random_rows(rng, 40)
        e = self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, self.client.append, "other", 0, more, more_kpe,
                            pool="tiny")
        self.assertIn("tiny", e.message)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "other", pool="tiny")
        # A stream whose later message overflows: the whole stream is rolled back.
        with mlakv.Client(self.server.target, timeout=CALL_TIMEOUT_S, chunk_bytes=8 * 1152 + 1024) as c:
            self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, c.append, "fill", 0, more, more_kpe,
                            pool="tiny")
        after = self.client.pool("tiny")
        self.assertEqual(after.pages_free, 1)
        self.assertEqual(self.client.sequence("fill", pool="tiny").layer_lengths[0], 40)
        self.assertEqual(self.client.free("fill", pool="tiny"), 3)
        self.assertEqual(self.client.pool("tiny").pages_free, 4)
        self.assertEqual(self.client.pool().pages_free, 64)


class TlsTokenTest(unittest.TestCase):
    """TLS with a bearer token: Client(token=..., credentials=...) is accepted, a missing
    or wrong token is UNAUTHENTICATED, and health stays open (as kubelet probes need)."""

    TOKEN = "s3cret-token-for-tests"

    @classmethod
    def setUpClass(cls):
        import shutil
        import subprocess
        import tempfile
        if not shutil.which("openssl"):
            raise unittest.SkipTest("openssl not installed (it makes the test certificate)")
        cls.dir = tempfile.mkdtemp(prefix="mlakv-tls-")
        cls.cert, key = os.path.join(cls.dir, "cert.pem"), os.path.join(cls.dir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", key, "-out", cls.cert], check=True, capture_output=True, timeout=60)
        token_file = os.path.join(cls.dir, "token")
        with open(token_file, "w") as f:
            f.write(cls.TOKEN + "\n")
        with open(cls.cert, "rb") as f:
            cls.creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        cls.server = ServerProcess("--tls_cert", cls.cert, "--tls_key", key, "--auth_token_file", token_file,
                                   credentials=cls.creds)
        cls.server.start()

    @classmethod
    def tearDownClass(cls):
        import shutil
        cls.server.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def client(self, token):
        return mlakv.Client(self.server.target, token=token, credentials=self.creds, timeout=CALL_TIMEOUT_S)

    def test_token_accepted(self):
        rng = np.random.default_rng(13)
        ckv, kpe = random_rows(rng, 3)
        with self.client(self.TOKEN) as c:
            self.assertEqual(c.append("tls", 0, ckv, kpe, ckv_scale=0.01, kpe_scale=0.05).rows_written, 3)
            self.assertEqual(c.export("tls", 0)["kpe"].shape, (3, 64))
            self.assertEqual(c.free("tls"), 1)

    def test_missing_or_wrong_token_unauthenticated(self):
        for token in (None, "wrong"):
            with self.subTest(token=token), self.client(token) as c:
                with self.assertRaises(mlakv.Error) as ctx:
                    c.pools()
                self.assertEqual(ctx.exception.code, grpc.StatusCode.UNAUTHENTICATED, str(ctx.exception))
                self.assertEqual(c.health(), "SERVING")


class OptionalDtypesTest(ServerTestCase):
    def test_torch_tensors(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch not installed")
        rng = np.random.default_rng(10)
        ckv, kpe = random_rows(rng, 20)
        tc = torch.from_numpy(ckv.view(np.int16)).view(torch.bfloat16)
        tk = torch.from_numpy(kpe.view(np.int16)).view(torch.bfloat16)
        self.client.append("torch", 0, tc, tk, ckv_scale=0.01, kpe_scale=0.05)
        self.client.append("numpy", 0, ckv, kpe)
        a, b = self.client.export("torch", 0), self.client.export("numpy", 0)
        np.testing.assert_array_equal(a["ckv_packed"], b["ckv_packed"])
        f16 = torch.from_numpy(ckv.astype(np.float32)).half()
        self.client.append("torch16", 1, f16, torch.zeros(20, 64, dtype=torch.float16), ckv_scale=0.01, kpe_scale=0.05)

    def test_ml_dtypes_bfloat16(self):
        try:
            import ml_dtypes
        except ImportError:
            self.skipTest("ml_dtypes not installed")
        rng = np.random.default_rng(11)
        ckv, kpe = random_rows(rng, 20)
        self.client.append("mld", 2, ckv.view(ml_dtypes.bfloat16), kpe.view(ml_dtypes.bfloat16),
                           ckv_scale=0.01, kpe_scale=0.05)
        self.client.append("u16", 2, ckv, kpe)
        np.testing.assert_array_equal(self.client.export("mld", 2)["ckv_packed"],
                                      self.client.export("u16", 2)["ckv_packed"])


if __name__ == "__main__":
    unittest.main()
