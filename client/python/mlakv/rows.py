"""Rows in: numpy arrays or torch tensors -> little-endian fp16/bf16 numpy arrays.

Accepted element types (ckv and kpe must agree):
  numpy float16                       -> ROW_DTYPE_FLOAT16
  numpy uint16 (bf16 bit patterns)    -> ROW_DTYPE_BFLOAT16
  numpy ml_dtypes.bfloat16            -> ROW_DTYPE_BFLOAT16
  torch.float16 / torch.bfloat16 (CPU)-> ROW_DTYPE_FLOAT16 / ROW_DTYPE_BFLOAT16
Anything else (float32, ...) is refused before anything is sent: the server
quantizes exactly the bits it receives, so the conversion is the caller's to
choose. CUDA tensors never come here: Client.append sends them by reference
(mlakv.regions).
"""

import numpy as np

from mlakv.errors import client_error
from mlakv.v1 import kv_cache_pb2 as pb

CKV_DIM = 512
KPE_DIM = 64
ELEMENT_BYTES = 2  # fp16 and bf16 alike


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "dtype")


def _torch_to_numpy(x, name):
    import torch  # optional dependency: only imported when a tensor is passed

    if x.device.type != "cpu":
        raise client_error(
            "%s is a %s tensor; device rows travel by reference (CUDA tensors only): pass %s.cpu()"
            % (name, x.device, name))
    x = x.detach().contiguous()
    if x.dtype == torch.float16:
        return x.numpy(), pb.ROW_DTYPE_FLOAT16
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), pb.ROW_DTYPE_BFLOAT16
    raise client_error("%s has dtype %s; expected torch.float16 or torch.bfloat16" % (name, x.dtype))


def to_numpy(x, name):
    """Returns (array, RowDType) for one input, little-endian, 2 bytes per element."""
    if _is_torch(x):
        return _torch_to_numpy(x, name)
    if not isinstance(x, np.ndarray):
        raise client_error("%s is a %s; expected a numpy array or a torch tensor" % (name, type(x).__name__))
    if x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16 (jax, ml_dtypes)
        return x.view(np.uint16), pb.ROW_DTYPE_BFLOAT16
    if x.dtype.kind == "f" and x.dtype.itemsize == 2:
        return x.astype("<f2", copy=False), pb.ROW_DTYPE_FLOAT16
    if x.dtype.kind == "u" and x.dtype.itemsize == 2:
        return x.astype("<u2", copy=False), pb.ROW_DTYPE_BFLOAT16
    raise client_error(
        "%s has dtype %s; expected float16, bfloat16 bit patterns as uint16, or ml_dtypes.bfloat16"
        % (name, x.dtype))


def _rows_2d(x, dim, name, leading, contiguous=True):
    """Checks the shape [*leading, N, dim] (a single row [dim] is allowed when leading is ())."""
    if not leading and x.ndim == 1 and x.shape[0] == dim:
        x = x.reshape(1, dim)
    want = len(leading) + 2
    if x.ndim != want or x.shape[-1] != dim or tuple(x.shape[:-2]) != tuple(leading):
        shape = ", ".join([str(d) for d in leading] + ["N", str(dim)])
        raise client_error("%s has shape %s; expected [%s]" % (name, list(x.shape), shape))
    return np.ascontiguousarray(x) if contiguous else x


def prepare(ckv, kpe, leading=(), what="", contiguous=True):
    """Validates a (ckv, kpe) pair; returns (ckv, kpe, dtype, rows) as numpy arrays
    (contiguous copies where needed unless contiguous=False, which keeps the
    caller's memory and layout).

    ckv is [*leading, N, 512] and kpe [*leading, N, 64] of one dtype.
    """
    ckv_name, kpe_name = what + "ckv", what + "kpe"
    ckv, ckv_dtype = to_numpy(ckv, ckv_name)
    kpe, kpe_dtype = to_numpy(kpe, kpe_name)
    if ckv_dtype != kpe_dtype:
        raise client_error("%s is %s but %s is %s; both must have one dtype" % (
            ckv_name, pb.RowDType.Name(ckv_dtype), kpe_name, pb.RowDType.Name(kpe_dtype)))
    ckv = _rows_2d(ckv, CKV_DIM, ckv_name, leading, contiguous)
    kpe = _rows_2d(kpe, KPE_DIM, kpe_name, leading, contiguous)
    if ckv.shape[-2] != kpe.shape[-2]:
        raise client_error("%s has %d rows but %s has %d" % (ckv_name, ckv.shape[-2], kpe_name, kpe.shape[-2]))
    return ckv, kpe, ckv_dtype, ckv.shape[-2]


def row_bytes():
    """Bytes of one token of one layer on the wire (ckv + kpe)."""
    return (CKV_DIM + KPE_DIM) * ELEMENT_BYTES
