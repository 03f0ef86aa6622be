#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/.

  tests/fuzz/make_corpus.py           (re)writes the generated seeds

safetensors_fuzzer/: files shaped like ../shared/vectors (ckv/kpe rows, F32 scales,
the expect_* tensors, __metadata__), with 1-2 rows so that each stays small,
plus the shapes a parser must get right: empty header, metadata only, a
scalar, a zero-size tensor, every dtype, a header padded with spaces.
server_config_fuzzer/: the config examples of docs/server.md and deploy/, copied
from those files (so a change there is a change here after a re-run), and a
few small ones. Files that fuzzing found (crash-*, regression-*) are kept,
not rewritten. Standard library only; deterministic output.
"""
import json
import os
import re
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")

DTYPE_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
              "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}


def safetensors(tensors, metadata=None, pad_to=8):
    """tensors: list of (name, dtype, shape); data is a deterministic pattern."""
    header, data, offset = {}, b"", 0
    for name, dtype, shape in tensors:
        n = DTYPE_SIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        data += bytes((offset + i) * 37 % 251 for i in range(n))
        offset += n
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % pad_to)
    return struct.pack("<Q", len(text)) + text + data


def raw_header(header):
    """A file of exactly this header and no data (for headers safetensors() cannot express)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text


def vectors_like(rows, dtype):
    return safetensors(
        [("ckv", dtype, [rows, 512]), ("kpe", dtype, [rows, 64]), ("ckv_scale", "F32", [1]),
         ("kpe_scale", "F32", [1]), ("expect_ckv_packed", "U8", [rows, 256]),
         ("expect_ckv_sf", "F8_E4M3", [rows, 32]), ("expect_kpe", "F8_E4M3", [rows, 64])],
        {"note": "seed shaped like ../shared/vectors", "rows": str(rows)})


def safetensors_seeds():
    return {
        "vectors_bf16_1row.safetensors": vectors_like(1, "BF16"),
        "vectors_f16_2rows.safetensors": vectors_like(2, "F16"),
        "rows_without_scales.safetensors": safetensors([("ckv", "BF16", [1, 512]), ("kpe", "BF16", [1, 64])]),
        "quantized_output.safetensors": safetensors(
            [("ckv_packed", "U8", [1, 256]), ("ckv_sf", "F8_E4M3", [1, 32]), ("kpe", "F8_E4M3", [1, 64])]),
        "empty_header.safetensors": safetensors([], pad_to=1),
        "metadata_only.safetensors": safetensors([], {"k": "v", "format": "pt"}),
        "scalar.safetensors": safetensors([("s", "F32", [])]),
        "zero_size.safetensors": safetensors([("z", "U8", [0, 4]), ("a", "I32", [2])]),
        "every_dtype.safetensors": safetensors([(d.lower(), d, [2]) for d in DTYPE_SIZE]),
        "padded_header.safetensors": safetensors([("x", "U16", [3, 1])], pad_to=64),
        "high_rank.safetensors": safetensors([("r", "U8", [1, 2, 1, 3, 1, 1, 2])]),
        # Regressions: no rows at all (row_file's memcpy to null), and a shape
        # whose element count wraps to 0 in 64 bits ([2^32, 2^32] in 0 bytes).
        "regression_zero_rows.safetensors": safetensors([("ckv", "BF16", [0, 512]), ("kpe", "BF16", [0, 64])]),
        "regression_shape_overflow.safetensors": raw_header(
            {"ckv_scale": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}),
    }


def fenced_blocks(path):
    with open(path) as f:
        return re.findall(r"```[a-z]*\n(.*?)```", f.read(), re.S)


def config_seeds():
    seeds = {}
    docs = [b for b in fenced_blocks(os.path.join(ROOT, "docs", "server.md")) if "pools {" in b]
    for i, block in enumerate(docs):
        seeds[f"docs_server_md_{i}.txtpb"] = block.encode()
    with open(os.path.join(ROOT, "deploy", "base", "server.textproto"), "rb") as f:
        seeds["deploy_base_server.txtpb"] = f.read()
    seeds["empty.txtpb"] = b""
    seeds["two_cpu_pools.txtpb"] = (b'pools { name: "a" device: "cpu" num_layers: 2 page_size: 16 num_pages: 8 }\n'
                                    b'pools { name: "b" device: "cpu" num_layers: 1 page_size: 1 num_pages: 1 '
                                    b'layer_scales { layer: 0 ckv_scale: 0.5 kpe_scale: 0.25 } }\n')
    seeds["cache_bytes.txtpb"] = b'pools { device: "cpu" num_layers: 1 page_size: 64 cache_bytes: 22528 }\n'
    seeds["listen_only.txtpb"] = b'listen: "127.0.0.1:0" max_message_bytes: 1048576\n'
    return seeds


def write(subdir, seeds):
    d = os.path.join(OUT, subdir)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    print(f"{d}: {len(seeds)} seeds")


if __name__ == "__main__":
    write("safetensors_fuzzer", safetensors_seeds())
    write("server_config_fuzzer", config_seeds())
