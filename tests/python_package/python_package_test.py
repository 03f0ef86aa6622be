#!/usr/bin/python3
"""`pip install ./client/python` as a user does it, offline: a copy of the
package's sources (client/python, proto/, VERSION) is installed with Debian's
pip and setuptools (--no-build-isolation --no-index) into a fresh virtual
environment, and a script run from an empty directory with an empty
environment (no PYTHONPATH, no MLAKV_* variables) imports it and saves a
prompt layer by layer into a real mlakv-server, reading it back.

  python_package_test.py --server MLAKV_SERVER --cli MLAKV_CLI
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

SCRIPT = r'''
import re, subprocess, sys, time
import numpy as np
import mlakv

server_bin, version = sys.argv[1], sys.argv[2]
assert mlakv.__version__ == version, (mlakv.__version__, version)
assert "site-packages" in mlakv.__file__, mlakv.__file__
assert mlakv.GENERATED_DIR in mlakv.pb.__file__, (mlakv.GENERATED_DIR, mlakv.pb.__file__)
log = open("server.log", "w+")
proc = subprocess.Popen([server_bin, "--listen", "127.0.0.1:0", "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT)
try:
    port = None
    for _ in range(400):
        log.seek(0)
        m = re.search(r" ready: grpc 127\.0\.0\.1:(\d+) ", log.read())
        if m:
            port = int(m.group(1))
            break
        time.sleep(0.05)
    assert port, "the server did not start"
    c = mlakv.Client("127.0.0.1:%d" % port, timeout=30)
    c.wait_ready()
    rng = np.random.default_rng(0)
    layers = [(rng.standard_normal((300, 512)).astype(np.float16), rng.standard_normal((300, 64)).astype(np.float16))
              for _ in range(4)]
    with c.save("req-1", ckv_scale=0.002, kpe_scale=0.01) as s:
        for i, (ckv, kpe) in enumerate(layers):
            s.layer(i, ckv, kpe)
    for i, (ckv, kpe) in enumerate(layers):
        c.append("req-2", i, ckv, kpe, start=0, ckv_scale=0.002, kpe_scale=0.01)
    for i in range(4):
        a, b = c.export("req-1", i), c.export("req-2", i)
        for k in ("ckv_packed", "ckv_sf", "kpe"):
            assert (a[k] == b[k]).all(), (i, k)
    assert c.sequence("req-1").layer_lengths[:4] == [300] * 4
    print("package ok: mlakv %s, layer-wise save of 4 x 300 rows byte-exact" % mlakv.__version__)
finally:
    proc.terminate()
    proc.wait(10)
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--cli", required=True)
    a = ap.parse_args()
    a.server, a.cli = os.path.abspath(a.server), os.path.abspath(a.cli)
    version = open(os.path.join(ROOT, "VERSION")).read().strip()
    # One version: the server's and the CLI's --version say VERSION too.
    for binary, name in ((a.server, "mlakv-server"), (a.cli, "mlakv")):
        said = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
        if said != "%s %s" % (name, version):
            print("FAIL: %s --version says %r; VERSION is %s" % (name, said, version))
            return 1
    tmp = tempfile.mkdtemp(prefix="mlakv-package-test-")
    try:
        src = os.path.join(tmp, "src")
        ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests", "examples")
        shutil.copytree(os.path.join(ROOT, "client", "python"), os.path.join(src, "client", "python"), ignore=ignore)
        shutil.copytree(os.path.join(ROOT, "proto"), os.path.join(src, "proto"))
        shutil.copy(os.path.join(ROOT, "VERSION"), os.path.join(src, "VERSION"))
        venv = os.path.join(tmp, "venv")
        # Debian's grpcio, protobuf and numpy are the dependencies; pip comes from the system too.
        subprocess.check_call(["/usr/bin/python3", "-m", "venv", "--system-site-packages", "--without-pip", venv])
        py = os.path.join(venv, "bin", "python")
        clean = {"PATH": "/usr/bin:/bin", "HOME": tmp}
        out = subprocess.run([py, "-m", "pip", "install", "--no-build-isolation", "--no-index",
                              os.path.join(src, "client", "python")], env=clean, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout[-4000:], out.stderr[-4000:])
            print("FAIL: pip install ./client/python")
            return 1
        print(out.stdout.strip().splitlines()[-1])
        # Nothing generated was left in the sources' package directory.
        leaked = [f for f in os.listdir(os.path.join(src, "client", "python", "mlakv")) if f in ("v1", "_version.py")]
        if leaked:
            print("FAIL: the build wrote %s into the source package" % leaked)
            return 1
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        run = subprocess.run([py, "-c", SCRIPT, a.server, version], cwd=work, env=clean, capture_output=True,
                             text=True, timeout=120)
        sys.stdout.write(run.stdout)
        if run.returncode != 0:
            sys.stdout.write(run.stderr[-4000:])
            print("FAIL: the installed package")
            return 1
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
