"""A tiny safetensors reader/writer on numpy (no dependency on the safetensors package).

BF16 tensors are returned as uint16 bit patterns, F8_E4M3 as uint8 bytes:
exactly what mlakv.Client.append accepts and mlakv.Client.export returns.
"""

import json
import struct

import numpy as np

_DTYPES = {
    "F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8",
    "U8": "u1", "I8": "i1", "F8_E4M3": "u1", "U16": "<u2", "I16": "<i2",
    "I32": "<i4", "U32": "<u4", "I64": "<i8", "U64": "<u8", "BOOL": "u1",
}


def load(path):
    """Every tensor of a .safetensors file: {name: numpy array}."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError("%s: too short for a safetensors header" % path)
    (header_len,) = struct.unpack("<Q", blob[:8])
    if 8 + header_len > len(blob):
        raise ValueError("%s: header length %d past the end of the file" % (path, header_len))
    header = json.loads(blob[8:8 + header_len])
    data = memoryview(blob)[8 + header_len:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in _DTYPES:
            raise ValueError("%s: tensor %s has unsupported dtype %s" % (path, name, dtype))
        lo, hi = info["data_offsets"]
        arr = np.frombuffer(data[lo:hi], dtype=_DTYPES[dtype])
        out[name] = arr.reshape(info["shape"]).copy()
    return out


def save(path, tensors, dtypes=None):
    """Writes {name: array}; dtypes optionally names the safetensors dtype per
    tensor (e.g. {"ckv": "BF16"} for uint16 bit patterns)."""
    dtypes = dtypes or {}
    rev = {"float16": "F16", "float32": "F32", "float64": "F64", "uint8": "U8", "int8": "I8",
           "uint16": "U16", "int16": "I16", "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64"}
    header, chunks, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtypes.get(name, rev[arr.dtype.name]), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(chunks))
