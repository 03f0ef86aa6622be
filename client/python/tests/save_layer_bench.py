"""The host time of a layer-wise save's s.layer() for CUDA tensors, by piece.

At 1k tokens a 61-layer prefill loop is bound by the host (docs/performance.md
"Where s.layer's host time goes"), so every microsecond s.layer() spends in
Python lengthens the loop. This program times, with no compute running and
the same client and server throughout (medians and p90 over --layers layers
x --saves saves, each piece in its own loop):

  * prepare (full checks): Client._prepare of one layer's (ckv, kpe) views,
    as every layer took before the layout was reused;
  * prepare (like the last): Client._prepare_layer with the previous layer's
    layout (views of one [layers, N, dim] buffer, shifted by a stride);
  * current stream: torch.cuda.current_stream, once a layer (the fence's stream);
  * s.layer: the whole call in a save of --layers layers of --tokens rows,
    the save committed (untimed) after each pass; split into the calls that
    hand a group of layers to the stream (every layers_per_message-th: the
    fence's event record and the queue's hand-over) and the others;
  * the same inside a stand-in forward pass (one [tokens, 7168] x [7168,
    7168] matmul per layer, as cuda_save_test.py's loop), where the GPU is
    busy and the caller's thread shares the GIL with the stream's.

    MLAKV_SERVER=.../mlakv-server MLAKV_PY_GEN=.../gen PYTHONPATH=client/python \\
        python3 client/python/tests/save_layer_bench.py [--tokens 1024] [--saves 20]

Needs torch with CUDA (exit 77 otherwise) and a server binary with --allow_ipc.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlakv  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from server_test_case import cuda_missing  # noqa: E402

SCALES = dict(ckv_scale=0.004, kpe_scale=0.02)


def summary(name, samples_s):
    us = sorted(x * 1e6 for x in samples_s)
    return "  %-28s p50 %7.1f us  p90 %7.1f us  (%d)" % (name, statistics.median(us), us[int(len(us) * 0.9)], len(us))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--saves", type=int, default=20)
    a = ap.parse_args()
    why = cuda_missing()
    if why:
        print("save_layer_bench: skipped: " + why)
        return 77
    import torch

    cfg = tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False)
    cfg.write('pools { name: "default" device: "cuda:0" num_layers: %d page_size: 64 num_pages: %d '
              'max_sequences: 8 }\n' % (a.layers, (a.tokens + 63) // 64 + 8))
    cfg.close()
    ckv = torch.randn(a.layers, a.tokens, 512, device="cuda:0").to(torch.bfloat16)
    kpe = torch.randn(a.layers, a.tokens, 64, device="cuda:0").to(torch.bfloat16)
    torch.cuda.synchronize()
    with ServerProcess("--allow_ipc", "--config", cfg.name, device="cuda:0") as server:
        with mlakv.Client(server.target, timeout=120, cuda_sync="event") as c:
            full, like_last, streams, layer = [], [], [], []
            c._prepare(ckv[0], kpe[0])  # the allocation registered once, untimed
            for _ in range(a.saves):
                for i in range(a.layers):
                    x, y = ckv[i], kpe[i]
                    t = time.perf_counter()
                    c._prepare(x, y)
                    full.append(time.perf_counter() - t)
                like = None
                if hasattr(c, "_prepare_layer"):  # a client from before the layout's reuse has none
                    _, like = c._prepare_layer(None, ckv[0], kpe[0])
                    for i in range(a.layers):
                        x, y = ckv[i], kpe[i]
                        t = time.perf_counter()
                        c._prepare_layer(like, x, y)
                        like_last.append(time.perf_counter() - t)
                for i in range(a.layers):
                    t = time.perf_counter()
                    torch.cuda.current_stream(0)
                    streams.append(time.perf_counter() - t)
            per_message = 8  # LayerwiseSave's default layers_per_message
            x_in = torch.randn(a.tokens, 7168, device="cuda:0", dtype=torch.bfloat16)
            w = torch.randn(7168, 7168, device="cuda:0", dtype=torch.bfloat16) / 7168 ** 0.5

            def saves(compute):
                hands, others = [], []
                for n in range(a.saves):
                    s = c.save("bench-%d" % n, **SCALES)
                    for i in range(a.layers):
                        if compute:  # the layer's compute writes its rows, as a forward pass would
                            y = torch.mm(x_in, w)
                            ckv[i].copy_(y[:, :512])
                            kpe[i].copy_(y[:, 512:576])
                        x, y = ckv[i], kpe[i]
                        t = time.perf_counter()
                        s.layer(i, x, y)
                        hand = (i + 1) % per_message == 0 or i + 1 == a.layers
                        (hands if hand else others).append(time.perf_counter() - t)
                    s.wait()
                    c.free("bench-%d" % n)
                return hands, others

            hands, others = saves(False)
            layer = hands + others
            loop_hands, loop_others = saves(True)
            from google.protobuf.internal import api_implementation

            print("s.layer of CUDA views, %d layers x %d tokens, %d saves (%s, torch %s, protobuf %s)" % (
                a.layers, a.tokens, a.saves, torch.cuda.get_device_name(0), torch.__version__,
                api_implementation.Type()))
            print(summary("prepare (full checks)", full))
            if like_last:
                print(summary("prepare (like the last)", like_last))
            print(summary("current stream", streams))
            print(summary("s.layer", layer))
            print(summary("  handing a group over", hands))
            print(summary("  the others", others))
            print(summary("s.layer in a forward pass", loop_hands + loop_others))
            print(summary("  handing a group over", loop_hands))
            print(summary("  the others", loop_others))
    os.unlink(cfg.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
