"""Layer-wise saves (Client.save, mlakv.save) against a real mlakv-server with
host rows: byte-exact against the blocking append, atomic under every failure
(a bad layer, a failing message, the caller's exception), the short-prompt
path, and the stream open while the caller is still giving layers."""

import threading
import time
import unittest

import grpc
import numpy as np

import mlakv
from server_test_case import ServerTestCase, random_rows

LAYERS = 61
SCALES = dict(ckv_scale=0.0015, kpe_scale=0.009)


def prompt(seed, tokens, dtype="bf16"):
    rng = np.random.default_rng(seed)
    return [random_rows(rng, tokens, dtype) for _ in range(LAYERS)]


class LayerwiseSaveTest(ServerTestCase):
    def exported(self, sequence, layers=range(LAYERS)):
        return [self.client.export(sequence, layer) for layer in layers]

    def assertSameStored(self, a, b):
        for layer, (x, y) in enumerate(zip(self.exported(a), self.exported(b))):
            for key in ("ckv_packed", "ckv_sf", "kpe"):
                np.testing.assert_array_equal(x[key], y[key], err_msg="layer %d %s" % (layer, key))
            self.assertEqual((x["ckv_scale"], x["kpe_scale"]), (y["ckv_scale"], y["kpe_scale"]))

    def assertPagesBack(self, expected=0, settle_s=0.5):
        """The pool's pages back to `expected`, and still there `settle_s`
        later. A cancel reaches the server as the end of the stream, which it
        handles after a message already on its way: that message may reserve
        its pages after the caller's wait() has raised, and the server rolls
        them back when it sees the cancel -- so a single look can see 0 just
        before the late message's pages appear (seen under ASan in CI, 5 != 0).
        Waits at most 10 s for `expected` to hold for `settle_s`."""
        deadline = time.monotonic() + 10
        held_since = None
        while time.monotonic() < deadline:
            if self.client.pool().pages_used != expected:
                held_since = None
            elif held_since is None:
                held_since = time.monotonic()
            elif time.monotonic() - held_since >= settle_s:
                break
            time.sleep(0.005)
        self.assertEqual(self.client.pool().pages_used, expected)

    def assertNotStored(self, sequence):
        with self.assertRaises(mlakv.Error) as ctx:
            self.client.sequence(sequence)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.NOT_FOUND, str(ctx.exception))

    def test_a_61_layer_save_stores_what_the_blocking_appends_store(self):
        rows = prompt(1, 300)
        with self.client.save("lw-300", commit_by_call=True, **SCALES) as s:
            for layer, (ckv, kpe) in enumerate(rows):
                s.layer(layer, ckv, kpe)
                if layer == 0:
                    # Layer-wise: the stream is open while the caller goes on,
                    # and nothing is visible before the commit.
                    self.assertTrue(s._opened())
                    self.assertNotStored("lw-300")
        self.assertTrue(s.done())
        self.assertTrue(s.committed_by_call, "the commit was the waiting thread's CommitAppend")
        seq = self.client.sequence("lw-300")
        self.assertEqual(seq.length, 300)
        for layer, (ckv, kpe) in enumerate(rows):
            self.client.append("blocking-300", layer, ckv, kpe, start=0, **SCALES)
        self.assertSameStored("lw-300", "blocking-300")
        self.client.free("lw-300")
        self.client.free("blocking-300")

    def test_a_short_prompt_goes_in_one_go_at_the_end(self):
        rows = prompt(2, 40, "f16")
        s = self.client.save("short", **SCALES)
        for layer, (ckv, kpe) in enumerate(rows):
            s.layer(layer, ckv, kpe)
        self.assertFalse(s._opened(), "below layerwise_min_tokens no stream is opened before wait()")
        resp = s.wait()
        self.assertEqual(resp.sequence.length, 40)
        for layer, (ckv, kpe) in enumerate(rows):
            self.client.append("short-blocking", layer, ckv, kpe, start=0, **SCALES)
        self.assertSameStored("short", "short-blocking")
        # Rows larger than a message travel in several messages of the one stream.
        big = prompt(3, 2000)[:3]
        with self.client.save("chunked", layerwise_min_tokens=0, **SCALES) as s:
            for layer, (ckv, kpe) in enumerate(big):
                s.layer(layer, ckv, kpe)
        for layer, (ckv, kpe) in enumerate(big):
            self.client.append("chunked-blocking", layer, ckv, kpe, start=0, **SCALES)
        for a, b in zip(self.exported("chunked", range(3)), self.exported("chunked-blocking", range(3))):
            np.testing.assert_array_equal(a["ckv_packed"], b["ckv_packed"])
        for sid in ("short", "short-blocking", "chunked", "chunked-blocking"):
            self.client.free(sid)

    def test_layers_go_to_the_stream_in_groups(self):
        rows = prompt(7, 300)[:10]
        with self.client.save("grouped", layers_per_message=4, **SCALES) as s:
            for layer, (ckv, kpe) in enumerate(rows):
                s.layer(layer, ckv, kpe)
                if layer == 2:
                    self.assertEqual(s._sent_layers, [], "three layers wait for the fourth")
        sizes = [len(layers) for layers in s._sent_layers]
        self.assertEqual(sum(sizes), 10, s._sent_layers)
        self.assertTrue(all(n >= 4 for n in sizes[:-1]), s._sent_layers)
        self.assertEqual([l for layers in s._sent_layers for l in layers], list(range(10)))
        for layer, (ckv, kpe) in enumerate(rows):
            self.client.append("grouped-blocking", layer, ckv, kpe, start=0, **SCALES)
        for a, b in zip(self.exported("grouped", range(10)), self.exported("grouped-blocking", range(10))):
            np.testing.assert_array_equal(a["ckv_packed"], b["ckv_packed"])
            np.testing.assert_array_equal(a["kpe"], b["kpe"])
        # One layer a message on request; a group size below 1 is refused.
        with self.client.save("one-by-one", layers_per_message=1, **SCALES) as s:
            s.layer(0, *rows[0])
            for _ in range(200):
                if s._sent_layers:
                    break
                time.sleep(0.01)
            self.assertEqual(s._sent_layers, [[0]], "the first layer goes before the save ends")
            s.layer(1, *rows[1])
        with self.assertRaises(mlakv.Error) as ctx:
            self.client.save("none", layers_per_message=0)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        for sid in ("grouped", "grouped-blocking", "one-by-one"):
            self.client.free(sid)

    def wait_sent(self, s, layers):
        for _ in range(500):
            with s._lock:
                sent = sorted(l for group in s._sent_layers for l in group)
            if sent == list(layers):
                return
            time.sleep(0.01)
        self.fail("layers sent before wait(): %s, expected %s" % (sent, list(layers)))

    def test_the_last_layer_sends_the_rest_at_once_but_commits_only_at_wait(self):
        rows = prompt(8, 300)
        # The pool's 61 layers: 61 = 7 x 8 + 5, and the last 5 go when layer 60 is given.
        s = self.client.save("last-at-once", layers_per_message=8, **SCALES)
        for layer, (ckv, kpe) in enumerate(rows):
            s.layer(layer, ckv, kpe)
        self.assertEqual(s._pending, [], "nothing waits for wait() once every layer is given")
        self.wait_sent(s, range(LAYERS))
        self.assertEqual(self.client._layer_counts, {"": LAYERS}, "the pool's layer count, looked up once")
        self.assertNotStored("last-at-once")  # every message sent; the commit waits for wait()
        self.assertEqual(s.wait().sequence.length, 300)
        for layer, (ckv, kpe) in enumerate(rows):
            self.client.append("last-at-once-blocking", layer, ckv, kpe, start=0, **SCALES)
        self.assertSameStored("last-at-once", "last-at-once-blocking")
        # A save of fewer layers says so; a body that raises after its last
        # layer went still writes nothing.
        with self.assertRaises(RuntimeError):
            with self.client.save("three", num_layers=3, layers_per_message=8, **SCALES) as s:
                for layer in range(3):
                    s.layer(layer, *rows[layer])
                self.wait_sent(s, range(3))
                raise RuntimeError("the forward pass failed after its last layer")
        self.assertNotStored("three")
        with self.client.save("three", num_layers=3, layers_per_message=8, **SCALES) as s:
            for layer in range(3):
                s.layer(layer, *rows[layer])
            self.wait_sent(s, range(3))
        self.assertEqual(list(self.client.sequence("three").layer_lengths[:4]), [300, 300, 300, 0])
        with self.assertRaises(mlakv.Error) as ctx:
            self.client.save("none", num_layers=0)
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        for sid in ("last-at-once", "last-at-once-blocking", "three"):
            self.client.free(sid)
        self.assertEqual(self.client.pool().pages_used, 0)

    def test_without_commit_append_the_streams_end_commits(self):
        """CommitAppend is only a faster end: a server without it
        (UNIMPLEMENTED, remembered for the client's life) or a commit call
        that fails in transit leaves the stream to commit at its half-close."""
        rows = prompt(10, 300)

        class Refused(grpc.RpcError):
            def __init__(self, code):
                self._code = code

            def code(self):
                return self._code

        real = self.client._stub.CommitAppend
        calls = []

        def failing(code):
            def call(*args, **kwargs):
                calls.append(code)
                raise Refused(code)
            return call

        try:
            for code, sid in ((grpc.StatusCode.UNAVAILABLE, "lost-commit"), (grpc.StatusCode.UNIMPLEMENTED, "old-server"),
                              (None, "after-old-server")):
                if code is not None:
                    self.client._stub.CommitAppend = failing(code)
                with self.client.save(sid, commit_by_call=True, **SCALES) as s:
                    for layer, (ckv, kpe) in enumerate(rows):
                        s.layer(layer, ckv, kpe)
                self.assertFalse(s.committed_by_call, sid)
                self.assertEqual(self.client.sequence(sid).length, 300, sid)
                self.client.free(sid)
            self.assertEqual(calls, [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED],
                             "after UNIMPLEMENTED the client no longer asks")
        finally:
            self.client._stub.CommitAppend = real
            self.client._no_commit_append = False
        with self.client.save("by-call-again", commit_by_call=True, **SCALES) as s:
            for layer, (ckv, kpe) in enumerate(rows):
                s.layer(layer, ckv, kpe)
        self.assertTrue(s.committed_by_call)
        self.client.free("by-call-again")
        self.assertEqual(self.client.pool().pages_used, 0)

    def test_the_stream_is_started_off_the_callers_thread(self):
        """The first layer hands the call's start (gRPC Python starts threads
        for it) to the client's opener thread; a save that ends below the
        threshold starts its call in wait(), on the caller's thread."""
        real = self.client._stub.Append
        started_on = []

        class Recording:
            def future(self, *args, **kwargs):
                started_on.append(threading.current_thread().name)
                return real.future(*args, **kwargs)

        rows = prompt(11, 300)
        self.client._stub.Append = Recording()
        try:
            for n in range(3):  # one opener thread for every save of the client
                with self.client.save("opened-%d" % n, **SCALES) as s:
                    for layer, (ckv, kpe) in enumerate(rows):
                        s.layer(layer, ckv, kpe)
            with self.client.save("short-inline", **SCALES) as s:
                for layer, (ckv, kpe) in enumerate(rows):
                    s.layer(layer, ckv[:40], kpe[:40])
        finally:
            self.client._stub.Append = real
        self.assertEqual(len(started_on), 4, started_on)
        self.assertEqual(len(set(started_on[:3])), 1, started_on)
        self.assertTrue(started_on[0].startswith("mlakv-save-open"), started_on)
        self.assertEqual(started_on[3], threading.current_thread().name)
        for n in range(3):
            self.assertEqual(self.client.sequence("opened-%d" % n).length, 300)
            self.client.free("opened-%d" % n)
        self.assertEqual(self.client.sequence("short-inline").length, 40)
        self.client.free("short-inline")

    def test_a_forked_child_gets_an_opener_of_its_own(self):
        """After a fork the parent's opener has no thread behind it in the
        child: a start there makes a new one (the pid is compared)."""
        client = mlakv.Client(self.server.target, timeout=30)
        try:
            self.assertEqual(client._start_in_background(lambda: 1).result(timeout=10), 1)
            parents = client._opener
            real_getpid = mlakv.client.os.getpid
            mlakv.client.os.getpid = lambda: real_getpid() + 1  # as in a child
            try:
                self.assertEqual(client._start_in_background(lambda: 2).result(timeout=10), 2)
            finally:
                mlakv.client.os.getpid = real_getpid
            self.assertIsNot(client._opener, parents)
            parents.shutdown(wait=True)
        finally:
            client.close()
        self.assertIsNone(client._start_in_background(lambda: 3), "a closed client starts nothing")

    def test_a_call_that_cannot_start_fails_the_save_and_writes_nothing(self):
        """What starting the call raised on the opener thread is raised by
        wait(); done() says the save ended; nothing is written."""
        real = self.client._stub.Append

        class Broken:
            def future(self, *args, **kwargs):
                raise ValueError("Cannot invoke RPC on closed channel!")

        rows = prompt(12, 300)
        self.client._stub.Append = Broken()
        try:
            s = self.client.save("never-started", **SCALES)
            for layer in range(5):
                s.layer(layer, *rows[layer])
            deadline = time.monotonic() + 10
            while not s.done() and time.monotonic() < deadline:
                time.sleep(0.001)
            self.assertTrue(s.done(), "a save whose call failed to start has ended")
            with self.assertRaises(mlakv.Error) as ctx:  # as every failure of a Client call
                s.wait()
            self.assertEqual(ctx.exception.code, grpc.StatusCode.UNKNOWN, str(ctx.exception))
            self.assertIn("ValueError: Cannot invoke RPC on closed channel!", ctx.exception.message)
            self.assertIn("nothing was written", ctx.exception.message)
            self.assertIsInstance(ctx.exception.__cause__, ValueError)
            with self.assertRaises(mlakv.Error) as again:  # and stays failed
                s.wait()
            self.assertIs(again.exception, ctx.exception)
        finally:
            self.client._stub.Append = real
        self.assertNotStored("never-started")
        self.assertEqual(self.client.pool().pages_used, 0)

    def test_closing_the_client_mid_save_writes_nothing(self):
        """A client closed while its save's call is being started or is open:
        the save fails at wait() and the server keeps nothing of it."""
        rows = prompt(13, 300)
        for given in (1, 30):
            client = mlakv.Client(self.server.target, timeout=30)
            s = client.save("closed-%d" % given, **SCALES)
            for layer in range(given):
                s.layer(layer, *rows[layer])
            client.close()
            with self.assertRaises(mlakv.Error) as ctx:
                s.wait()
            self.assertEqual(ctx.exception.code, grpc.StatusCode.CANCELLED, str(ctx.exception))
            self.assertNotStored("closed-%d" % given)
        self.assertPagesBack()

    def test_a_save_on_a_closed_client_fails_at_wait(self):
        """The layer that would open the stream returns (as every s.layer);
        wait() raises why, as an mlakv.Error."""
        client = mlakv.Client(self.server.target, timeout=30)
        client.close()
        s = client.save("after-close", **SCALES)
        rows = prompt(17, 300)
        s.layer(0, *rows[0])
        s.layer(1, *rows[1])
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION, str(ctx.exception))
        self.assertIn("layer 0", ctx.exception.message)
        self.assertIn("closed", ctx.exception.message)
        self.assertNotStored("after-close")

    def test_closing_the_client_ends_a_save_never_waited_for(self):
        """A save dropped without wait(): close() cancels it -- its pages come
        back and its stream's thread (blocked on the save's queue) ends."""
        before = threading.active_count()
        client = mlakv.Client(self.server.target, timeout=30)
        rows = prompt(18, 300)
        s = client.save("dropped", **SCALES)
        for layer in range(30):
            s.layer(layer, *rows[layer])
        deadline = time.monotonic() + 10
        while self.client.pool().pages_used == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        self.assertGreater(self.client.pool().pages_used, 0, "the save's stream is open")
        client.close()
        self.assertTrue(s.done())
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.CANCELLED, str(ctx.exception))
        self.assertIn("client was closed", ctx.exception.message)
        self.assertNotStored("dropped")
        self.assertPagesBack()
        del s
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertLessEqual(threading.active_count(), before,
                             [t.name for t in threading.enumerate()])

    def test_an_interrupted_wait_cancels_the_save_and_says_what_is_known(self):
        """KeyboardInterrupt inside wait(): raised as it came, the save
        cancelled, and every later wait() raises CANCELLED saying whether the
        commit had been asked for."""
        rows = prompt(19, 300)

        class Interrupting:
            def __init__(self, call):
                self.call = call

            def result(self, *args, **kwargs):
                raise KeyboardInterrupt()

            def __getattr__(self, name):
                return getattr(self.call, name)

        # Before the commit is asked for: CommitAppend interrupted on its way out.
        real = self.client._stub.CommitAppend

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt()

        self.client._stub.CommitAppend = interrupted
        try:
            s = self.client.save("ctrl-c-early", commit_by_call=True, **SCALES)
            for layer in range(LAYERS):
                s.layer(layer, *rows[layer])
            with self.assertRaises(KeyboardInterrupt):
                s.wait()
        finally:
            self.client._stub.CommitAppend = real
        self.assertTrue(s.done())
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.CANCELLED, str(ctx.exception))
        self.assertIn("KeyboardInterrupt", ctx.exception.message)
        # The commit call was made from wait(), so the message cannot say "nothing".
        self.assertIn("may have committed", ctx.exception.message)
        self.assertNotStored("ctrl-c-early")  # it never reached the server: the stream was cancelled
        self.assertPagesBack()
        # While waiting for the stream's answer, its end sent.
        s = self.client.save("ctrl-c-late", **SCALES)
        for layer in range(LAYERS):
            s.layer(layer, *rows[layer])
        s._stream()
        s._future = Interrupting(s._future)
        with self.assertRaises(KeyboardInterrupt):
            s.wait()
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.CANCELLED, str(ctx.exception))
        self.assertIn("may have committed", ctx.exception.message)
        self.assertTrue(s.done())
        try:  # either outcome is allowed; whichever it is, the pool's books balance
            self.client.free("ctrl-c-late")
        except mlakv.Error as err:
            self.assertEqual(err.code, grpc.StatusCode.NOT_FOUND, str(err))
        self.assertPagesBack()

    def test_a_negative_layer_is_named_and_nothing_is_written(self):
        rows = prompt(20, 300)
        for bad in (-1, 2**32):
            s = self.client.save("negative", **SCALES)
            s.layer(0, *rows[0])
            s.layer(bad, *rows[1])
            with self.assertRaises(mlakv.Error) as ctx:
                s.wait()
            self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT, str(ctx.exception))
            self.assertIn("layer %d" % bad, ctx.exception.message)
            self.assertNotStored("negative")
        self.assertPagesBack()

    def test_a_layers_own_scale_falls_back_to_the_saves_for_the_other(self):
        rows = prompt(21, 300)
        with self.client.save("own-scale", **SCALES) as s:
            for layer in range(LAYERS):
                s.layer(layer, *rows[layer], ckv_scale=0.002 if layer == 3 else None)
        for layer in range(LAYERS):
            scales = dict(SCALES, ckv_scale=0.002) if layer == 3 else SCALES
            self.client.append("own-scale-blocking", layer, *rows[layer], start=0, **scales)
        self.assertSameStored("own-scale", "own-scale-blocking")
        self.assertEqual(self.client.export("own-scale", 3)["ckv_scale"], np.float32(0.002))
        self.client.free("own-scale")
        self.client.free("own-scale-blocking")

    def test_a_save_waited_for_inside_its_block_stays_committed_when_the_block_raises(self):
        rows = prompt(22, 300)
        with self.assertRaises(RuntimeError):
            with self.client.save("waited-inside", **SCALES) as s:
                for layer in range(LAYERS):
                    s.layer(layer, *rows[layer])
                first = s.wait()
                raise RuntimeError("after the commit")
        self.assertEqual(self.client.sequence("waited-inside").length, 300)
        self.assertIs(s.wait(), first)
        self.client.free("waited-inside")

    def test_a_save_to_a_pool_that_does_not_exist_fails_naming_the_pool(self):
        s = self.client.save("nowhere", pool="no-such-pool", **SCALES)
        s.layer(0, *prompt(9, 300)[0])
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.NOT_FOUND, str(ctx.exception))
        self.assertIn("no-such-pool", ctx.exception.message)
        self.assertIn("layer 0", ctx.exception.message)

    def test_a_layer_the_client_rejects_is_named_and_nothing_is_written(self):
        rows = prompt(4, 300)
        s = self.client.save("bad-shape", **SCALES)
        for layer, (ckv, kpe) in enumerate(rows):
            if layer == 17:
                ckv = ckv[:, :500]
            s.layer(layer, ckv, kpe)  # returns; the failure waits for wait()
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("layer 17", ctx.exception.message)
        self.assertNotStored("bad-shape")
        # A layer given twice, rows that change count: named too.
        for second in ((0, rows[0]), (1, (rows[1][0][:10], rows[1][1][:10]))):
            s = self.client.save("twice", **SCALES)
            s.layer(0, *rows[0])
            s.layer(second[0], *second[1])
            with self.assertRaises(mlakv.Error) as ctx:
                s.wait()
            self.assertIn("layer %d" % second[0], ctx.exception.message)
            self.assertNotStored("twice")

    def test_a_message_the_server_refuses_rolls_back_every_layer(self):
        rows = prompt(5, 300)
        # Layer 7 takes scales first, so a save naming others is refused there.
        self.client.append("scales-7", 7, rows[7][0][:1], rows[7][1][:1], start=0, ckv_scale=0.5, kpe_scale=0.5)
        try:
            with self.assertRaises(mlakv.Error) as ctx:
                with self.client.save("refused", **SCALES) as s:
                    for layer in range(LAYERS):
                        s.layer(layer, *rows[layer])
            self.assertEqual(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION, str(ctx.exception))
            self.assertIn("layer 7", ctx.exception.message)
            self.assertNotStored("refused")
            self.assertEqual(self.client.pool().pages_used, self.client.sequence("scales-7").capacity_tokens // 64)
        finally:
            self.client.free("scales-7")

    def test_the_callers_exception_cancels_the_save(self):
        rows = prompt(6, 300)
        with self.assertRaises(RuntimeError):
            with self.client.save("raised", **SCALES) as s:
                for layer in range(10):
                    s.layer(layer, *rows[layer])
                raise RuntimeError("the forward pass failed")
        self.assertNotStored("raised")
        self.assertPagesBack()
        with self.assertRaises(mlakv.Error) as ctx:
            s.wait()
        self.assertEqual(ctx.exception.code, grpc.StatusCode.CANCELLED)
        # No layer at all: refused, nothing written.
        with self.assertRaises(mlakv.Error) as ctx:
            self.client.save("empty").wait()
        self.assertIn("no layer", ctx.exception.message)


if __name__ == "__main__":
    unittest.main()
