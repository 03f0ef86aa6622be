"""Leases, generations, forks, block hashes and prefix matches through the
Python client, against a real mlakv-server process (configured pools: "cm", 2
layers x 32 pages of 16 tokens; "lru", 2 layers x 4 pages of 16 tokens with
LRU eviction). Run by ctest (python_client) like test_client.py.
"""

import hashlib
import os
import tempfile
import time
import unittest

import grpc
import numpy as np

import mlakv
from server_test_case import ServerTestCase, random_rows

PAGE = 16
LAYERS = [0, 1]
CKV_SCALE, KPE_SCALE = 0.01, 0.05


def chain(tag, pages):
    """A block-hash chain: each hash covers its parent's and its page's tag."""
    out, parent = [], b""
    for i in range(pages):
        parent = hashlib.sha256(parent + ("%s/%d" % (tag, i)).encode()).digest()
        out.append(parent)
    return out


class CacheManagementTest(ServerTestCase):

    @classmethod
    def setUpClass(cls):
        cls.config = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
        cls.config.write('pools { name: "cm" num_layers: 2 page_size: 16 num_pages: 32 }\n'
                         'pools { name: "lru" num_layers: 2 page_size: 16 num_pages: 4 eviction { policy: "lru" } }\n')
        cls.config.close()
        cls.server_args = ("--config", cls.config.name)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        os.unlink(cls.config.name)

    def setUp(self):
        self.rng = np.random.default_rng(abs(hash(self.id())) % (1 << 32))

    def tearDown(self):
        for pool in ("cm", "lru"):
            for lease in self.client.list_leases(pool=pool):
                self.client.release_lease(lease.lease_id, pool=pool)
            for s in self.client.sequences(pool=pool):
                self.client.free(s.id, pool=pool)
            p = self.client.pool(pool)
            self.assertEqual((p.pages_used, p.leases, p.sequences_retained), (0, 0, 0), str(p))

    def put(self, sequence, n=40, pool="cm", **kwargs):
        """n random rows into both layers of `sequence`; returns the AppendResponse."""
        ckv, kpe = random_rows(self.rng, n)
        return self.client.append(sequence, LAYERS, np.stack([ckv, ckv]), np.stack([kpe, kpe]), start=0,
                                  pool=pool, ckv_scale=CKV_SCALE, kpe_scale=KPE_SCALE, **kwargs)

    # -- generations --------------------------------------------------------

    def test_generation_preconditions(self):
        resp = self.put("gen")
        gen = resp.sequence.generation
        self.assertGreater(gen, 0)
        seq = self.client.get_sequence("gen", pool="cm", expect_generation=gen)
        self.assertEqual((seq.generation, seq.length, seq.leases, seq.pinned, seq.shared_pages), (gen, 40, 0, False, 0))
        e = self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.sequence, "gen", pool="cm",
                            expect_generation=gen + 1)
        self.assertIn(str(gen), e.message)
        # An append, truncate or free pinned to another incarnation changes nothing.
        ckv, kpe = random_rows(self.rng, 1)
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.append, "gen", LAYERS,
                        np.stack([ckv, ckv]), np.stack([kpe, kpe]), start=40, pool="cm", expect_generation=gen + 1)
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.truncate, "gen", 8, pool="cm",
                        expect_generation=gen + 1)
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.free, "gen", pool="cm",
                        expect_generation=gen + 1)
        self.assertEqual(self.client.sequence("gen", pool="cm").length, 40)
        self.assertEqual(self.client.truncate("gen", 20, pool="cm", expect_generation=gen).length, 20)
        self.assertEqual(self.put("gen", 0, expect_generation=gen).sequence.generation, gen)
        self.assertEqual(self.client.free("gen", pool="cm", expect_generation=gen), 2)
        # A new incarnation of the id has a new generation.
        self.assertNotEqual(self.put("gen").sequence.generation, gen)

    # -- leases -------------------------------------------------------------

    def test_lease_lifecycle_keeps_a_freed_sequence_readable(self):
        gen = self.put("leased").sequence.generation
        before = self.client.export("leased", 0, pool="cm")
        lease = self.client.acquire_lease("leased", "py-worker", duration_ms=20000, tokens=32, pool="cm",
                                          expect_generation=gen)
        self.assertGreater(lease.lease_id, 0)
        self.assertEqual((lease.pool, lease.sequence, lease.generation, lease.holder, lease.tokens),
                         ("cm", "leased", gen, "py-worker", 32))
        self.assertEqual(lease.duration_ms, 20000)
        self.assertGreater(lease.expire_time_unix_ms, int(time.time() * 1000))
        self.assertFalse(lease.sequence_freed)
        listed = self.client.list_leases(pool="cm")
        self.assertEqual([l.lease_id for l in listed], [lease.lease_id])
        self.assertEqual(self.client.sequence("leased", pool="cm").leases, 1)
        self.assertEqual(self.client.pool("cm").leases, 1)
        # What the lease protects cannot be cut; past it stays writable.
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.truncate, "leased", 31, pool="cm")
        self.assertEqual(self.client.truncate("leased", 32, pool="cm").length, 32)

        renewed = self.client.renew_lease(lease.lease_id, duration_ms=40000, pool="cm")
        self.assertEqual((renewed.lease_id, renewed.duration_ms), (lease.lease_id, 40000))
        self.assertGreaterEqual(renewed.expire_time_unix_ms, lease.expire_time_unix_ms)

        freed = self.client.free_sequence("leased", pool="cm")
        self.assertEqual((freed.pages_freed, freed.leases, freed.pages_retained), (0, 1, 2))
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "leased", pool="cm")
        pool = self.client.pool("cm")
        self.assertEqual((pool.sequences, pool.sequences_retained, pool.pages_used), (0, 1, 2))
        self.assertTrue(self.client.list_leases(pool="cm")[0].sequence_freed)
        # The freed incarnation through its lease.
        through = self.client.export("", 0, count=32, pool="cm", lease_id=lease.lease_id)
        np.testing.assert_array_equal(through["kpe"], before["kpe"][:32])
        np.testing.assert_array_equal(through["ckv_packed"], before["ckv_packed"][:32])

        self.assertEqual(self.client.release_lease(lease.lease_id, pool="cm"), 2)
        self.assertEqual(self.client.pool("cm").pages_used, 0)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.renew_lease, lease.lease_id, pool="cm")
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.release_lease, lease.lease_id, pool="cm")

    def test_get_sequence_takes_a_lease_atomically(self):
        self.put("read-me", 24)
        seq = self.client.get_sequence("read-me", pool="cm", lease="decoder", lease_duration_ms=5000)
        self.assertTrue(seq.HasField("lease"))
        self.assertEqual((seq.lease.holder, seq.lease.tokens, seq.lease.sequence, seq.lease.generation),
                         ("decoder", 24, "read-me", seq.generation))
        self.assertEqual(seq.leases, 1)
        options = mlakv.pb.LeaseOptions(holder="decoder-2", duration_ms=5000)
        second = self.client.sequence("read-me", pool="cm", lease=options)
        self.assertEqual(second.lease.holder, "decoder-2")
        self.assertEqual(second.leases, 2)
        self.assertEqual(sorted(l.lease_id for l in self.client.list_leases(pool="cm")),
                         sorted([seq.lease.lease_id, second.lease.lease_id]))
        self.assertFalse(self.client.sequence("read-me", pool="cm").HasField("lease"))
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.sequence, "read-me", pool="cm", lease=3)

    def test_list_leases_follows_page_tokens(self):
        self.put("many", 16)
        ids = [self.client.acquire_lease("many", "h%d" % i, pool="cm").lease_id for i in range(5)]
        listed = self.client.list_leases(pool="cm", page_size=2)
        self.assertEqual([l.lease_id for l in listed], sorted(ids))
        self.assertEqual([l.holder for l in listed], ["h%d" % i for i in range(5)])

    # -- forks --------------------------------------------------------------

    def test_fork_shares_full_pages_and_copies_the_partial_one(self):
        src = self.put("src").sequence
        fork = self.client.fork_sequence("src", "dst", pool="cm", expect_generation=src.generation)
        self.assertEqual((fork.pages_shared, fork.pages_copied), (2, 1))
        self.assertEqual(fork.sequence.id, "dst")
        self.assertEqual(fork.sequence.length, 40)
        self.assertEqual(list(fork.sequence.kv_indices[:2]), list(src.kv_indices[:2]))
        self.assertNotEqual(fork.sequence.kv_indices[2], src.kv_indices[2])
        self.assertNotEqual(fork.sequence.generation, src.generation)
        self.assertEqual(self.client.sequence("dst", pool="cm").shared_pages, 2)
        self.assertEqual(self.client.sequence("src", pool="cm").shared_pages, 2)
        self.assertEqual(self.client.pool("cm").pages_shared, 2)
        for layer in LAYERS:
            a, b = self.client.export("src", layer, pool="cm"), self.client.export("dst", layer, pool="cm")
            for k in ("ckv_packed", "ckv_sf", "kpe"):
                np.testing.assert_array_equal(a[k], b[k])
        # A prefix, pinned.
        short = self.client.fork_sequence("src", "dst-16", length=16, pin=True, pool="cm")
        self.assertEqual((short.pages_shared, short.pages_copied, short.sequence.length), (1, 0, 16))
        self.assertTrue(short.sequence.pinned)
        self.assertTrue(self.client.sequence("dst-16", pool="cm").pinned)
        # Errors.
        self.assertCode(grpc.StatusCode.ALREADY_EXISTS, self.client.fork_sequence, "src", "dst", pool="cm")
        self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.client.fork_sequence, "src", "too-long", length=41,
                        pool="cm")
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.fork_sequence, "src", "x", pool="cm",
                        expect_generation=src.generation + 1000)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.fork_sequence, "no-such", "y", pool="cm")
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.fork_sequence, "", "z", pool="cm")
        self.assertTrue(e.message.startswith("client: "), e.message)
        # Freeing the source leaves the fork's pages in place.
        self.client.free("src", pool="cm")
        self.assertEqual(self.client.export("dst", 0, pool="cm")["kpe"].shape, (40, 64))

    # -- block hashes and prefix matches ------------------------------------

    def test_block_hashes_match_prefix_and_fork_from_hashes(self):
        hashes = chain("py-prefix", 3)
        seq = self.put("hashed", 40, block_hashes=hashes, pin=True).sequence
        self.assertTrue(seq.pinned)
        # Pages 0 and 1 are complete; page 2 (8 of 16 tokens) is not indexed yet.
        match = self.client.match_prefix(hashes, pool="cm")
        self.assertEqual((match.matched_pages, match.matched_tokens), (2, 32))
        self.assertEqual(list(match.kv_indices), list(seq.kv_indices[:2]))
        self.assertFalse(match.HasField("lease"))
        self.assertEqual(self.client.pool("cm").pages_indexed, 2)
        page = self.client.page(seq.kv_indices[0], pool="cm")
        self.assertTrue(page.indexed)
        self.assertEqual(page.block_hash_hex, hashes[0].hex())
        self.assertEqual(self.client.match_prefix([b"\x01" * 8] + hashes, pool="cm").matched_pages, 0)

        leased = self.client.match_prefix(hashes[:1], pool="cm", lease="prefetch", lease_duration_ms=5000)
        self.assertEqual(leased.matched_pages, 1)
        self.assertEqual((leased.lease.sequence, list(leased.lease.pages), leased.lease.holder),
                         ("", list(seq.kv_indices[:1]), "prefetch"))
        self.assertEqual(self.client.page(seq.kv_indices[0], pool="cm").references, 2)
        self.assertEqual(self.client.release_lease(leased.lease.lease_id, pool="cm"), 0)

        fork = self.client.fork_from_hashes(hashes, "from-hashes", pool="cm")
        self.assertEqual((fork.pages_shared, fork.pages_copied, fork.sequence.length), (2, 0, 32))
        self.assertEqual(list(fork.sequence.kv_indices), list(seq.kv_indices[:2]))
        none = self.client.fork_from_hashes(chain("not-cached", 2), "nothing", pool="cm")
        self.assertFalse(none.HasField("sequence"))
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "nothing", pool="cm")

        # Client-side checks: hashes are a list of bytes.
        for bad in ("abcd", [hashes[0].hex()], b"\x01\x02"):
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.match_prefix, bad, pool="cm")
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.fork_from_hashes, [], "t", pool="cm")
        # Server-side: a hash of 65 bytes.
        e = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.match_prefix, [b"x" * 65], pool="cm")
        self.assertIn("65", e.message)

    def test_block_hashes_from_a_later_page_and_append_batch(self):
        hashes = chain("py-batch", 2)
        self.put("batched", 16)
        ckv, kpe = random_rows(self.rng, 16)
        gen = self.client.sequence("batched", pool="cm").generation
        resp = self.client.append_batch([mlakv.SequenceRows(
            "batched", {0: (ckv, kpe), 1: (ckv, kpe)}, start=16, expect_generation=gen,
            block_hashes=hashes[1:], block_hashes_first_page=1)], pool="cm", ckv_scale=CKV_SCALE,
            kpe_scale=KPE_SCALE)
        self.assertEqual(resp.sequences[0].length, 32)
        # Page 1 is indexed under hashes[1]; page 0 has no hash, so a chain from hashes[0] matches nothing.
        self.assertEqual(self.client.match_prefix(hashes, pool="cm").matched_pages, 0)
        self.assertEqual(list(self.client.match_prefix(hashes[1:], pool="cm").kv_indices),
                         [resp.sequences[0].kv_indices[1]])
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.append_batch, [mlakv.SequenceRows(
            "batched", {0: (ckv, kpe), 1: (ckv, kpe)}, start=32, expect_generation=gen + 1)], pool="cm")
        self.assertEqual(self.client.sequence("batched", pool="cm").length, 32)

    # -- eviction -----------------------------------------------------------

    def test_lru_eviction_passes_pinned_and_leased_sequences_by(self):
        self.put("old", 40, pool="lru")  # 3 of 4 pages
        self.put("new", 40, pool="lru")  # evicts "old"
        pool = self.client.pool("lru")
        self.assertEqual(pool.eviction, mlakv.pb.EVICTION_POLICY_LRU)
        self.assertEqual((pool.evictions, pool.evicted_pages), (1, 3))
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.sequence, "old", pool="lru")
        # A leased sequence is not evicted: the append that would need its pages fails.
        lease = self.client.acquire_lease("new", "keeper", pool="lru")
        self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, self.put, "third", 40, pool="lru")
        self.client.release_lease(lease.lease_id, pool="lru")
        self.client.free("new", pool="lru")
        # Nor is a pinned one.
        self.put("pinned", 40, pool="lru", pin=True)
        self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, self.put, "fourth", 40, pool="lru")
        self.assertEqual(self.client.pool("lru").evictions, 1)
        self.assertEqual(self.client.pool("cm").eviction, mlakv.pb.EVICTION_POLICY_NONE)


if __name__ == "__main__":
    unittest.main()
