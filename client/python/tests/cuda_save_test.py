"""Layer-wise saves of CUDA tensors (client.save with cuda_sync="event") to
`mlakv-server --allow_ipc` on cuda:0, in a 61-layer loop where a stand-in
compute kernel (a bf16 matmul sized like a layer's projection) writes each
layer's ckv/kpe on the current stream and s.layer() hands the rows over by
reference at once. Checks the stored bytes against the blocking path (the
same rows sent as bytes, layer by layer), then measures, for 1k, 4k and 16k
tokens: the loop without saving, the loop with the save, and the time from
the last layer's compute to the commit (medians of --runs runs), both with
wait() called after a host synchronize (the tail then holds the whole end of
the stream) and as a connector calls it, right after the forward pass is
enqueued (the connector_wait_* figures).

Exits 77 (ctest: skipped) without torch, CUDA or a GPU.

    MLAKV_SERVER=.../mlakv-server MLAKV_PY_GEN=.../gen PYTHONPATH=client/python \\
        python3 client/python/tests/cuda_save_test.py [--runs 5] [--json OUT.json]
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import mlakv  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from server_test_case import cuda_missing  # noqa: E402

LAYERS = 61
HIDDEN = 7168  # DeepSeek-V3's hidden size: the stand-in layer is one [T, 7168] x [7168, 7168] matmul
SCALES = dict(ckv_scale=0.004, kpe_scale=0.02)
CONFIG = ('pools { name: "default" device: "cuda:0" num_layers: 61 page_size: 64 num_pages: 1100 '
          'max_sequences: 64 }\n')


class Loop:
    """The 61-layer forward pass of a prompt of `tokens` tokens."""

    def __init__(self, torch, tokens):
        self.t = torch
        g = torch.Generator(device="cuda:0").manual_seed(tokens)
        self.x = torch.randn(tokens, HIDDEN, device="cuda:0", dtype=torch.bfloat16, generator=g)
        self.w = torch.randn(HIDDEN, HIDDEN, device="cuda:0", dtype=torch.bfloat16, generator=g) / HIDDEN ** 0.5
        self.ckv = torch.empty(LAYERS, tokens, 512, device="cuda:0", dtype=torch.bfloat16)
        self.kpe = torch.empty(LAYERS, tokens, 64, device="cuda:0", dtype=torch.bfloat16)

    def layer(self, i):
        """Layer i's compute, writing its MLA rows (different for every layer)."""
        y = self.t.mm(self.x, self.w)
        self.ckv[i].copy_(y[:, (i * 64) % 6656:(i * 64) % 6656 + 512] * 4)
        self.kpe[i].copy_(y[:, 7000:7064] * 4)

    def run(self, save=None):
        """Returns the host seconds spent inside save.layer()."""
        in_save = 0.0
        for i in range(LAYERS):
            self.layer(i)
            if save is not None:
                t = time.perf_counter()
                save.layer(i, self.ckv[i], self.kpe[i])
                in_save += time.perf_counter() - t
        return in_save


def check_exact(client, torch, tokens):
    """Saved by reference == sent as bytes, every layer."""
    loop = Loop(torch, tokens)
    with client.save("exact-%d" % tokens, **SCALES) as s:
        loop.run(s)
    torch.cuda.synchronize()
    for i in range(LAYERS):
        client.append("exact-bytes-%d" % tokens, i, loop.ckv[i].cpu(), loop.kpe[i].cpu(), start=0, **SCALES)
    for i in range(LAYERS):
        a, b = client.export("exact-%d" % tokens, i), client.export("exact-bytes-%d" % tokens, i)
        for k in ("ckv_packed", "ckv_sf", "kpe"):
            if not np.array_equal(a[k], b[k]):
                raise AssertionError("%d tokens, layer %d: %s differs from the bytes path" % (tokens, i, k))
    client.free("exact-%d" % tokens)
    client.free("exact-bytes-%d" % tokens)


def check_interleaved(client, torch, tokens):
    """Two saves open at once in one thread, out of the same allocations (a
    connector saving two requests of one batch): both commit, byte-exact."""
    loop = Loop(torch, tokens)
    half = tokens // 2
    a, b = client.save("first-half", **SCALES), client.save("second-half", **SCALES)
    for i in range(LAYERS):
        loop.layer(i)
        a.layer(i, loop.ckv[i][:half], loop.kpe[i][:half])
        b.layer(i, loop.ckv[i][half:], loop.kpe[i][half:])
    a.wait()
    b.wait()
    torch.cuda.synchronize()
    for name, rows in (("first-half", slice(0, half)), ("second-half", slice(half, tokens))):
        for i in (0, 30, 60):
            client.append(name + "-bytes", i, loop.ckv[i][rows].cpu(), loop.kpe[i][rows].cpu(), start=0, **SCALES)
            x, y = client.export(name, i), client.export(name + "-bytes", i)
            for k in ("ckv_packed", "ckv_sf", "kpe"):
                if not np.array_equal(x[k], y[k]):
                    raise AssertionError("interleaved save %s layer %d: %s differs" % (name, i, k))
        client.free(name)
        client.free(name + "-bytes")


def check_two_streams(client, torch, tokens):
    """A save whose layers are written on two streams in turn: each layer's
    event goes on its own stream (a group never spans two), byte-exact."""
    loop = Loop(torch, tokens)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    fenced = []  # the streams of each group's fence, as the save records them
    real = client._fence

    def recording(regions, streams=None):
        fenced.append([s.cuda_stream for s in streams.values()])
        return real(regions, streams)

    client._fence = recording
    try:
        with client.save("two-streams", layers_per_message=8, **SCALES) as s:
            for i in range(LAYERS):
                with torch.cuda.stream(streams[i % 2]):
                    loop.layer(i)
                    s.layer(i, loop.ckv[i], loop.kpe[i])
    finally:
        client._fence = real
    want = [[streams[i % 2].cuda_stream] for i in range(LAYERS)]
    if fenced != want:
        raise AssertionError("groups' events on streams %s, expected one layer a group on its stream" % fenced)
    torch.cuda.synchronize()
    for i in (0, 1, 59, 60):
        client.append("two-streams-bytes", i, loop.ckv[i].cpu(), loop.kpe[i].cpu(), start=0, **SCALES)
        a, b = client.export("two-streams", i), client.export("two-streams-bytes", i)
        for k in ("ckv_packed", "ckv_sf", "kpe"):
            if not np.array_equal(a[k], b[k]):
                raise AssertionError("two streams, layer %d: %s differs from the bytes path" % (i, k))
    client.free("two-streams")
    client.free("two-streams-bytes")


def measure(client, torch, tokens, runs, per_message, last_at_once=True, poll_wait=False):
    """last_at_once=False: the layers still waiting after the last layer go at
    wait() (num_layers never reached), as before the save knew its layer count."""
    loop = Loop(torch, tokens)
    base, total, commit, end_save, in_layer = [], [], [], [], []
    total_early, commit_early = [], []
    # Warm-up: cuBLAS, and the allocations' one registration with the server.
    loop.run()
    with client.save("warm", **SCALES) as s:
        loop.run(s)
    client.free("warm")
    def loop_alone():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop.run()
        torch.cuda.synchronize()
        base.append(time.perf_counter() - t0)

    def loop_saving(sid):
        t0 = time.perf_counter()
        s = client.save(sid, layers_per_message=per_message, num_layers=None if last_at_once else 1 << 30,
                        commit_by_call=True, **SCALES)
        s._poll_wait = poll_wait
        in_layer.append(loop.run(s))
        torch.cuda.synchronize()  # the last layer's compute is done
        t_last = time.perf_counter()
        s.wait()
        t_commit = time.perf_counter()
        total.append(t_commit - t0)
        commit.append(t_commit - t_last)
        client.free(sid)

    def loop_saving_connector(sid):
        """wait() as vLLM's wait_for_save comes: right after the forward pass
        is enqueued, the GPU still computing. The tail is read on the GPU's
        clock: from an event after the last layer's compute to one recorded
        once wait() has returned (the GPU idle by then, so it completes as
        soon as it is submitted: a few us late, never early)."""
        t0 = time.perf_counter()
        s = client.save(sid, layers_per_message=per_message, num_layers=None if last_at_once else 1 << 30,
                        commit_by_call=True, **SCALES)
        s._poll_wait = poll_wait
        loop.run(s)
        last = torch.cuda.Event(enable_timing=True)
        last.record()
        s.wait()
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        after.synchronize()
        total_early.append(time.perf_counter() - t0)
        commit_early.append(last.elapsed_time(after) / 1e3)
        client.free(sid)

    # The GPU's clock falls under this sustained matmul load (the same loop
    # reads ~5% slower after a few runs than before), so the loop alone and
    # the loop saving alternate which goes first.
    for r in range(runs):
        sid = "m-%d-%d" % (tokens, r)
        if r % 2 == 0:
            loop_alone()
            loop_saving(sid)
            loop_saving_connector(sid + "-c")
        else:
            loop_saving_connector(sid + "-c")
            loop_saving(sid)
            loop_alone()

        # For comparison: everything in one save after the loop.
        t0 = time.perf_counter()
        loop.run()
        torch.cuda.synchronize()
        t_last = time.perf_counter()
        with client.save(sid + "-end", layerwise_min_tokens=1 << 30, **SCALES) as s:
            for i in range(LAYERS):
                s.layer(i, loop.ckv[i], loop.kpe[i])
        end_save.append(time.perf_counter() - t_last)
        client.free(sid + "-end")
    med = statistics.median
    return {
        "tokens": tokens,
        "layers": LAYERS,
        "layers_per_message": per_message,
        "last_layers_at_once": last_at_once,
        "runs": runs,
        "wait": "poll" if poll_wait else "future",
        "loop_without_save_ms": med(base) * 1e3,
        "loop_with_layerwise_save_ms": med(total) * 1e3,
        "overhead_pct": (med(total) - med(base)) / med(base) * 100,
        "last_compute_to_commit_ms": med(commit) * 1e3,
        "last_compute_to_commit_all_ms": [c * 1e3 for c in commit],
        "save_after_loop_ms": med(end_save) * 1e3,
        "connector_wait_loop_with_save_ms": med(total_early) * 1e3,
        "connector_wait_overhead_pct": (med(total_early) - med(base)) / med(base) * 100,
        "connector_wait_last_compute_to_commit_ms": med(commit_early) * 1e3,
        "connector_wait_last_compute_to_commit_all_ms": [c * 1e3 for c in commit_early],
        "host_in_layer_calls_ms": med(in_layer) * 1e3,
    }


def measure_stream_end(client, torch, tokens, runs=15):
    """The end of a save alone: the GPU idle and every message already at the
    server when wait() is called (61 layers, and one layer), against a
    GetPool from the same client: what the tail costs beyond the writes."""
    loop = Loop(torch, tokens)
    loop.run()
    torch.cuda.synchronize()
    med = statistics.median
    rtt = []
    for _ in range(200):
        t0 = time.perf_counter()
        client.pool()
        rtt.append(time.perf_counter() - t0)
    out = {"tokens": tokens, "getpool_us": med(rtt) * 1e6}
    for name, layers in (("wait_61_layers_us", LAYERS), ("wait_one_layer_us", 1)):
        waits = []
        for r in range(runs):
            sid = "end-%d-%d" % (tokens, r)
            s = client.save(sid, layers_per_message=8, num_layers=layers, **SCALES)
            for i in range(layers):
                s.layer(i, loop.ckv[i], loop.kpe[i])
            time.sleep(0.03)  # every message handled by the server
            t0 = time.perf_counter()
            s.wait()
            waits.append(time.perf_counter() - t0)
            client.free(sid)
        out[name] = med(waits) * 1e6
    return out


_END_RE = re.compile(r"Append pool='[^']*' sequence='m-(\d+)-\d+(-c)?' .* end us: to_task=(-?\d+) events=(-?\d+) "
                     r"write_commit=(-?\d+) to_respond=(-?\d+)( written_before_end=1)?")


def server_end_summary(log):
    """Medians of the server's end phases (append_reactor.cc's debug line) of
    the measured saves, by size and by how wait() was called."""
    groups = {}
    for m in _END_RE.finditer(log):
        key = (int(m.group(1)), "connector" if m.group(2) else "after_sync")
        groups.setdefault(key, []).append([int(x) for x in m.group(3, 4, 5, 6)] + [1 if m.group(7) else 0])
    out = []
    for (tokens, how), rows in sorted(groups.items()):
        cols = list(zip(*rows))
        out.append({"server_end_us": tokens, "wait": how, "saves": len(rows),
                    **{name: statistics.median(c) for name, c in
                       zip(("to_task", "events", "write_commit", "to_respond"), cols)},
                    "written_before_end": sum(cols[4])})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--layers_per_message", default="8", help="comma-separated: each is measured")
    ap.add_argument("--cuda_sync", default="event", help="the client's cuda_sync: event (the server waits for "
                    "the producer's events) or stream (the client synchronizes its stream per group)")
    ap.add_argument("--stream_end", action="store_true", help="also time the end of a save alone (GPU idle)")
    ap.add_argument("--last_at_once", default="1", help="comma-separated 1/0: the last layers sent when given (1) "
                    "or at wait() (0); each is measured")
    ap.add_argument("--wait", default="future", help="comma-separated: future (wait() sleeps on the call) and/or "
                    "poll (wait() polls it; an experiment); each is measured")
    ap.add_argument("--commit", default="call", help="comma-separated: call (wait() commits by CommitAppend) and/or "
                    "end (by the stream's end, as against a server without CommitAppend); each is measured")
    ap.add_argument("--server_end", action="store_true", help="run the server at --log_level debug and print, per "
                    "size, the medians of where the end of each measured save went on the server (the half-close to "
                    "the commit task, the producer's events, the write and commit); a diagnostic: the debug log "
                    "costs the server a little on every call")
    a = ap.parse_args()
    why = cuda_missing()
    if why:
        print("cuda_save_test: skipped: " + why)
        return 77
    import torch

    cfg = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
    cfg.write(CONFIG)
    cfg.close()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sizes": []}
    log_args = ("--log_level", "debug") if a.server_end else ()
    with ServerProcess("--allow_ipc", "--config", cfg.name, *log_args, device="cuda:0") as server:
        with mlakv.Client(server.target, timeout=120, cuda_sync=a.cuda_sync) as client:
            for tokens in (300, 4096):
                check_exact(client, torch, tokens)
            print("byte-exact: 61 layers x 300 and x 4096 tokens saved by reference == sent as bytes", flush=True)
            check_interleaved(client, torch, 2048)
            print("byte-exact: two saves open at once in one thread, out of one allocation", flush=True)
            check_two_streams(client, torch, 1024)
            print("byte-exact: layers written on two streams in turn, each fenced on its own", flush=True)
            for tokens in [int(x) for x in a.tokens.split(",")]:
                for per_message, at_once, poll, commit in [(int(x), y != "0", w == "poll", c)
                                                           for x in a.layers_per_message.split(",")
                                                           for y in a.last_at_once.split(",") for w in a.wait.split(",")
                                                           for c in a.commit.split(",")]:
                    client._no_commit_append = commit == "end"
                    r = measure(client, torch, tokens, a.runs, per_message, at_once, poll)
                    r["commit"] = commit
                    client._no_commit_append = False
                    results["sizes"].append(r)
                    print(json.dumps({k: v for k, v in r.items() if not k.endswith("_all_ms")}), flush=True)
            if a.stream_end:
                for tokens in [int(x) for x in a.tokens.split(",")]:
                    r = measure_stream_end(client, torch, tokens)
                    results.setdefault("stream_end", []).append(r)
                    print(json.dumps(r), flush=True)
            if a.server_end:
                for line in server_end_summary(server.log_text()):
                    print(json.dumps(line), flush=True)
            if client.pool().pages_used != 0:
                raise AssertionError("pages left behind: %s" % client.pool())
    os.unlink(cfg.name)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
