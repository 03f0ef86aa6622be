"""What the end of a call costs gRPC Python, against mlakv-server (cpu pool).

The layer-wise save's tail (issue 18: the time from the last layer's compute
to the commit) ends an Append stream: the request thread that gRPC Python runs
for a stream wakes for the half-close, the server commits, and the channel's
thread and then the caller's wake for the answer. This program measures those
pieces with no GPU, the same client against the same server in one run
(medians and p90 of --calls calls each):

  * unary GetPool and a one-row AppendBatch, blocking (the calling thread
    polls the call itself) and as futures (the channel's thread polls);
  * a one-row Append stream, blocking and as a future;
  * the end of a one-row stream alone (its message sent and handled, then
    --quiet of nothing, then the half-close -> the answer), split into the
    request thread's wake-up and the rest;
  * the tail of client.save() with 61 layers of host rows (bytes, sent in
    groups of 8): 100 ms after the last layer (every group written by then),
    how long wait() takes -- committed by CommitAppend from the waiting
    thread (the default), and by the stream's end.

    MLAKV_SERVER=build/server/mlakv-server MLAKV_PY_GEN=build/client/python/gen \\
        PYTHONPATH=client/python python3 client/python/tests/stream_end_bench.py [--calls 300]
"""

import argparse
import os
import queue
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import mlakv  # noqa: E402
from mlakv.v1 import kv_cache_pb2 as pb  # noqa: E402
from mlakv.v1 import kv_cache_pb2_grpc as pb_grpc  # noqa: E402
from server_process import ServerProcess  # noqa: E402

LAYERS = 61
SCALES = dict(ckv_scale=0.02, kpe_scale=0.05)


def summary(values, skip=20):
    v = sorted(values[skip:] if len(values) > 2 * skip else values)
    return statistics.median(v) * 1e6, v[int(0.9 * (len(v) - 1))] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--quiet_ms", default="0,1,5,20", help="comma-separated quiet spells before a stream's end")
    ap.add_argument("--server", default="", help="HOST:PORT of a running server (else one is started)")
    a = ap.parse_args()
    quiets = [float(q) / 1e3 for q in a.quiet_ms.split(",") if q]
    if a.server:
        run(a.server, a.calls, quiets)
        return
    with ServerProcess() as server:
        run(server.target, a.calls, quiets)


def run(target, calls, quiets):
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.KvCacheStub(channel)
    client = mlakv.Client(target)
    rng = np.random.default_rng(7)
    one = pb.LayerRows(layer=0, ckv=rng.standard_normal(512).astype(np.float16).tobytes(),
                       kpe=rng.standard_normal(64).astype(np.float16).tobytes(), **SCALES)
    message = pb.AppendRequest(pool="", sequence="end-bench", row_count=1, dtype=pb.ROW_DTYPE_FLOAT16,
                               view=pb.SEQUENCE_VIEW_LENGTHS, layers=[one])
    batch = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_FLOAT16, view=pb.SEQUENCE_VIEW_LENGTHS,
                                  sequences=[pb.SequenceRows(sequence="end-bench", row_count=1, layers=[one])])

    def free(sid="end-bench"):
        try:
            stub.FreeSequence(pb.FreeSequenceRequest(sequence=sid))
        except grpc.RpcError:
            pass

    def timed(fn, after=free):
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            after()
        return out

    rows = {}
    rows["GetPool, blocking"] = timed(lambda: stub.GetPool(pb.GetPoolRequest()), after=lambda: None)
    rows["GetPool, future"] = timed(lambda: stub.GetPool.future(pb.GetPoolRequest()).result(), after=lambda: None)
    rows["AppendBatch of one row, blocking"] = timed(lambda: stub.AppendBatch(batch))
    rows["AppendBatch of one row, future"] = timed(lambda: stub.AppendBatch.future(batch).result())
    rows["Append stream of one row, blocking"] = timed(lambda: stub.Append(iter([message])))
    rows["Append stream of one row, future"] = timed(lambda: stub.Append.future(iter([message])).result())

    for quiet in quiets:
        wake, rest = [], []
        for _ in range(calls):
            gate = queue.Queue()
            resumed = []

            def requests():
                yield message
                gate.get()
                resumed.append(time.perf_counter())

            future = stub.Append.future(requests())
            time.sleep(quiet)
            t0 = time.perf_counter()
            gate.put(None)
            future.result()
            t1 = time.perf_counter()
            wake.append(resumed[0] - t0)
            rest.append(t1 - resumed[0])
            free()
        rows["stream end after %g ms quiet: request thread wakes" % (quiet * 1e3)] = wake
        rows["stream end after %g ms quiet: half-close -> answer" % (quiet * 1e3)] = rest

    layer_rows = [(rng.standard_normal((64, 512)).astype(np.float16), rng.standard_normal((64, 64)).astype(np.float16))
                  for _ in range(LAYERS)]
    tails = {"call": [], "end": [], "poll": []}
    for i in range(max(calls // 10, 20)):
        for how in tails:
            sid = "save-%d" % i
            client._no_commit_append = how != "call"
            s = client.save(sid, layers_per_message=8, layerwise_min_tokens=1, commit_by_call=True, **SCALES)
            s._poll_wait = how == "poll"
            for layer, (ckv, kpe) in enumerate(layer_rows):
                s.layer(layer, ckv, kpe)
            time.sleep(0.1)  # every group sent and written (a 4k-token forward pass is ~40 ms on an H100)
            t0 = time.perf_counter()
            s.wait()
            tails[how].append(time.perf_counter() - t0)
            if s.committed_by_call != (how == "call"):
                raise AssertionError("save %s: committed_by_call %s" % (how, s.committed_by_call))
            free(sid)
    client._no_commit_append = False
    rows["save of 61 x 64 host rows: wait() 100 ms after the last layer (CommitAppend)"] = tails["call"]
    rows["  the same, committed by the stream's end"] = tails["end"]
    rows["  the same, the stream's end, wait() polling its call"] = tails["poll"]

    print("stream_end_bench: %d calls each, target %s (cpu pool)" % (calls, target))
    for name, values in rows.items():
        p50, p90 = summary(values)
        print("  %-62s p50 %8.1f us  p90 %8.1f us" % (name, p50, p90))


if __name__ == "__main__":
    main()
