"""Builds the mlakv package with its gRPC stubs generated from the protos.

The version is the repository's VERSION file (one number for the server, the
CLI and this package), written into mlakv/_version.py of the build. The
stubs (mlakv/v1/kv_cache_pb2*.py, config_pb2*.py) are generated here by protoc
with grpc_python_plugin -- found through $MLAKV_PROTOC / $MLAKV_GRPC_PYTHON_PLUGIN,
else on PATH -- from $MLAKV_PROTO_DIR, else ../../proto. Offline with
Debian's setuptools: pip install --no-build-isolation --no-index ./client/python
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PROTOS = ["mlakv/v1/kv_cache.proto", "mlakv/v1/config.proto"]


def read_version():
    for path in (os.path.join(ROOT, "VERSION"), os.path.join(HERE, "VERSION")):
        if os.path.isfile(path):
            with open(path) as f:
                return f.read().strip()
    raise SystemExit("mlakv: no VERSION file (expected %s)" % os.path.join(ROOT, "VERSION"))


def tool(env, name):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise SystemExit("mlakv: %s not found (set %s, or install Debian's protobuf-compiler and "
                         "protobuf-compiler-grpc)" % (name, env))
    return path


class BuildWithStubs(build_py):
    """build_py, then the stubs and _version.py into the build's mlakv/."""

    def run(self):
        super().run()
        proto_dir = os.environ.get("MLAKV_PROTO_DIR") or os.path.join(ROOT, "proto")
        out = self.build_lib
        os.makedirs(os.path.join(out, "mlakv", "v1"), exist_ok=True)
        cmd = [tool("MLAKV_PROTOC", "protoc"), "--proto_path=" + proto_dir, "--python_out=" + out,
               "--grpc_python_out=" + out,
               "--plugin=protoc-gen-grpc_python=" + tool("MLAKV_GRPC_PYTHON_PLUGIN", "grpc_python_plugin")]
        subprocess.check_call(cmd + [os.path.join(proto_dir, p) for p in PROTOS])
        with open(os.path.join(out, "mlakv", "v1", "__init__.py"), "w") as f:
            f.write('"""Generated from proto/mlakv/v1 at build time."""\n')
        with open(os.path.join(out, "mlakv", "_version.py"), "w") as f:
            f.write("__version__ = %r\n" % read_version())


setup(version=read_version(), cmdclass={"build_py": BuildWithStubs})
