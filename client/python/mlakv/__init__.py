"""Python client of the mlakv KV-cache service (mlakv.v1.KvCache).

    import mlakv
    c = mlakv.Client("127.0.0.1:50051")
    c.append("req-1", layer=0, ckv=ckv, kpe=kpe)   # [N,512] and [N,64], fp16 or bf16
    seq = c.sequence("req-1")                      # page table: seq.kv_indices, seq.last_page_len
    rows = c.export("req-1", layer=0)              # stored NVFP4 bytes as numpy arrays
    c.free("req-1")

Many servers as one (mlakv.Fleet, mlakv.fleet): calls for a sequence go to
the server rendezvous hashing of its id picks, the same one the C++ client
and `mlakv --servers` pick:
    fleet = mlakv.Fleet(service="dns:///mlakv.kv.svc.cluster.local:50051")
    fleet.append("req-1", layer=0, ckv=ckv, kpe=kpe)

With a server started with --allow_ipc, rows can travel by reference instead
of bytes: CUDA torch tensors passed to append, views of an mlakv.ShmRows, or
mlakv.RegionRows (see mlakv.regions).

Installed (`pip install ./client/python`), the package carries its gRPC
stubs, generated from proto/ when it was built (never committed), in
mlakv/v1/. Run from the source tree instead, it finds the stubs the CMake
build generated, in this order:
  1. the environment variable MLAKV_PY_GEN (the `gen` directory itself);
  2. <build>/client/python/gen with <build> = $MLAKV_BUILD_DIR (relative to the
     repository root unless absolute), as scripts/setup.sh uses it;
  3. <repo>/build/client/python/gen (scripts/setup.sh's default build dir).
Either way they are importable as mlakv.v1.kv_cache_pb2 and
mlakv.v1.kv_cache_pb2_grpc (from the source tree this package extends its own
__path__ with <gen>/mlakv, since protoc names them after the proto package
mlakv.v1).
"""

import os as _os


_HERE = _os.path.dirname(__file__)


def _installed():
    """True when the stubs were built into this package (pip install)."""
    return _os.path.isfile(_os.path.join(_HERE, "v1", "kv_cache_pb2_grpc.py"))


def _version():
    try:
        from mlakv._version import __version__ as v  # written by setup.py
        return v
    except ImportError:
        path = _os.path.join(_HERE, "..", "..", "..", "VERSION")  # the source tree's
        with open(path) as f:
            return f.read().strip()


def _find_generated():
    tried = []
    env = _os.environ.get("MLAKV_PY_GEN")
    if env:
        tried.append(env)
    else:
        repo = _os.path.abspath(_os.path.join(_os.path.dirname(__file__), "..", "..", ".."))
        build = _os.environ.get("MLAKV_BUILD_DIR", "build")
        if not _os.path.isabs(build):
            build = _os.path.join(repo, build)
        tried.append(_os.path.join(build, "client", "python", "gen"))
        tried.append(_os.path.join(repo, "build", "client", "python", "gen"))
    for gen in tried:
        if _os.path.isfile(_os.path.join(gen, "mlakv", "v1", "kv_cache_pb2_grpc.py")):
            return gen
    raise ImportError(
        "mlakv: generated gRPC stubs not found (looked in %s). Build them with "
        "`ninja -C <build> mlakv_python` and set MLAKV_PY_GEN=<build>/client/python/gen."
        % ", ".join(tried))


if _installed():
    GENERATED_DIR = _os.path.dirname(_HERE)
else:
    GENERATED_DIR = _find_generated()
    __path__.append(_os.path.join(GENERATED_DIR, "mlakv"))  # noqa: F821 (package __path__)
__version__ = _version()

from mlakv.v1 import kv_cache_pb2 as pb  # noqa: E402  (needs the __path__ above)
from mlakv.v1 import kv_cache_pb2_grpc as pb_grpc  # noqa: E402

from mlakv.errors import Error  # noqa: E402
from mlakv.client import Client, SequenceRows  # noqa: E402
from mlakv.regions import RegionRows, ShmRows  # noqa: E402
from mlakv.fleet import Fleet  # noqa: E402
from mlakv.save import LayerwiseSave  # noqa: E402

__all__ = ["__version__", "Client", "Error", "Fleet", "LayerwiseSave", "RegionRows", "SequenceRows", "ShmRows", "pb", "pb_grpc", "GENERATED_DIR"]
