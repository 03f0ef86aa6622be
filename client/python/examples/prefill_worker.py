#!/usr/bin/python3
"""A disaggregated prefill worker: it runs a prompt through the model's layers
and saves each layer's MLA rows (512 compressed-kv + 64 rope channels per
token) layer by layer while the next layers run (`client.save`: each
`s.layer` returns at once, leaving the block commits every layer in one
atomic append), then checks the page table a decode worker would attend
with, and frees the sequence.

The "model" here draws random rows; a PyTorch worker passes its own
bf16/fp16 tensors (CPU, or CUDA with a server started with --allow_ipc) to
the same `s.layer` call. --blocking sends each layer with one blocking
`client.append` instead, for comparison.

    /usr/bin/python3 client/python/examples/prefill_worker.py --target 127.0.0.1:50051
    MLAKV_PY_GEN=build/client/python/gen PYTHONPATH=client/python ...   (if not run from the tree)

Exit status 0 when every check passed.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import mlakv  # noqa: E402

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def layer_rows(rng, tokens, dtype, use_torch):
    """One layer's output for the prompt: ckv [tokens, 512] and kpe [tokens, 64]."""
    ckv = rng.standard_normal((tokens, 512), dtype=np.float32)
    kpe = rng.standard_normal((tokens, 64), dtype=np.float32) * 2.0
    if use_torch:
        import torch
        tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
        return torch.from_numpy(ckv).to(tdtype), torch.from_numpy(kpe).to(tdtype)
    if dtype == "f16":
        return ckv.astype(np.float16), kpe.astype(np.float16)
    return to_bf16(ckv), to_bf16(kpe)


def to_bf16(x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def amax(x):
    if hasattr(x, "float"):  # torch
        return float(x.float().abs().max())
    if x.dtype == np.uint16:  # bf16 bits
        x = (x.astype(np.uint32) << 16).view(np.float32)
    return float(np.abs(x.astype(np.float32)).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    ap.add_argument("--pool", default="", help="pool name (default: the server's default pool)")
    ap.add_argument("--sequence", default="prefill-%d" % os.getpid(), help="sequence id (the request id)")
    ap.add_argument("--tokens", type=int, default=300, help="prompt length")
    ap.add_argument("--layers", type=int, default=0, help="layers to send (default: all of the pool's)")
    ap.add_argument("--dtype", choices=("bf16", "f16"), default="bf16")
    ap.add_argument("--torch", action="store_true", help="send torch tensors (needs torch)")
    ap.add_argument("--token", default=os.environ.get("MLAKV_TOKEN"), help="auth token, if the server wants one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocking", action="store_true", help="one blocking append per layer instead of a save")
    args = ap.parse_args()

    client = mlakv.Client(args.target, token=args.token, timeout=60.0)
    client.wait_ready(timeout=10.0)
    pool = client.pool(args.pool)
    layers = args.layers or pool.num_layers
    print("pool %s on %s: %d layers, page size %d, %d/%d pages free"
          % (pool.name, pool.device, pool.num_layers, pool.page_size, pool.pages_free, pool.pages_total))

    # Prefill, layer by layer: each layer's rows leave as soon as the layer is done.
    rng = np.random.default_rng(args.seed)
    sent_bytes, t0 = 0, time.monotonic()
    save = None if args.blocking else client.save(args.sequence, start=0, pool=args.pool)
    for layer in range(layers):
        ckv, kpe = layer_rows(rng, args.tokens, args.dtype, args.torch)
        scales = pool.layers[layer] if layer < len(pool.layers) else None
        if scales is not None and scales.set:
            ckv_scale = kpe_scale = None  # the layer's scales are fixed: use them
        else:  # calibrate: the block amax maps to e4m3 max x e2m1 max
            ckv_scale = max(amax(ckv), 1e-3) / (E2M1_MAX * E4M3_MAX)
            kpe_scale = max(amax(kpe), 1e-3) / E4M3_MAX
        if save is not None:
            save.layer(layer, ckv, kpe, ckv_scale=ckv_scale, kpe_scale=kpe_scale)  # returns at once
        else:
            resp = client.append(args.sequence, layer, ckv, kpe, start=0, pool=args.pool,
                                 ckv_scale=ckv_scale, kpe_scale=kpe_scale)
            if resp.rows_written != args.tokens:
                return fail("layer %d: %d rows written, sent %d" % (layer, resp.rows_written, args.tokens))
        sent_bytes += args.tokens * 576 * 2
    if save is not None:
        resp = save.wait()  # one fence, one commit of every layer
        if resp.rows_written != args.tokens * layers:
            return fail("%d rows written, sent %d x %d layers" % (resp.rows_written, args.tokens, layers))
    dt = time.monotonic() - t0
    print("sent %d layers x %d tokens (%s): %.1f MB in %.3f s, %.1f MB/s"
          % (layers, args.tokens, args.dtype, sent_bytes / 1e6, dt, sent_bytes / 1e6 / dt))

    # What a decode worker asks for: the page table and lengths.
    seq = client.sequence(args.sequence, pool=args.pool)
    pages = math.ceil(args.tokens / pool.page_size)
    want_last = args.tokens - (pages - 1) * pool.page_size
    print("sequence %s: length %d, kv_indices %s, last_page_len %d"
          % (seq.id, seq.length, list(seq.kv_indices), seq.last_page_len))
    lengths = list(seq.layer_lengths[:layers])
    if lengths != [args.tokens] * layers:
        return fail("layer lengths %s, expected %d in each of %d layers" % (lengths, args.tokens, layers))
    if layers == pool.num_layers and seq.length != args.tokens:
        return fail("sequence length %d, expected %d" % (seq.length, args.tokens))
    if len(seq.kv_indices) != pages or seq.last_page_len != want_last:
        return fail("%d pages with last_page_len %d, expected %d pages with %d"
                    % (len(seq.kv_indices), seq.last_page_len, pages, want_last))
    if len(set(seq.kv_indices)) != pages:
        return fail("a page appears twice in %s" % list(seq.kv_indices))

    # The stored NVFP4 bytes of the last layer, and their dequantized values.
    stored = client.export(args.sequence, layers - 1, pool=args.pool)
    if stored["ckv_packed"].shape != (args.tokens, 256) or stored["kpe"].shape != (args.tokens, 64):
        return fail("export shapes %s %s" % (stored["ckv_packed"].shape, stored["kpe"].shape))
    deq = client.read_dequantized(args.sequence, layers - 1, count=4, pool=args.pool)
    print("layer %d stored: ckv_packed %s, ckv_sf %s, kpe %s; first row dequantized ckv[:4] %s"
          % (layers - 1, stored["ckv_packed"].shape, stored["ckv_sf"].shape, stored["kpe"].shape,
             np.array2string(deq["ckv"][0, :4], precision=3)))

    # Request done: release the pages.
    freed = client.free(args.sequence, pool=args.pool)
    if freed != pages:
        return fail("freed %d pages, expected %d" % (freed, pages))
    try:
        client.sequence(args.sequence, pool=args.pool)
        return fail("sequence still exists after free")
    except mlakv.Error as err:
        if err.code.name != "NOT_FOUND":
            raise
    print("freed %d pages; OK" % freed)
    return 0


def fail(msg):
    print("prefill_worker: FAILED: " + msg, file=sys.stderr)
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except mlakv.Error as err:
        print("prefill_worker: %s" % err, file=sys.stderr)
        sys.exit(1)
