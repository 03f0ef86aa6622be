"""ctest python_prefill_worker_example: examples/prefill_worker.py against a fresh server.

Starts mlakv-server ($MLAKV_SERVER) on a free loopback port, runs the example
(61 layers x 300 bf16 tokens saved layer-wise, 61 layers x 129 f16 tokens
in one go at the end, 61 layers x 129 with blocking appends), requires exit
status 0 and its "OK" line, checks the pool has every page back, and stops the
server. Exit status 0 on success.
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the mlakv package

import mlakv  # noqa: E402
from server_process import ServerProcess  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "prefill_worker.py")


def main():
    with ServerProcess() as server:
        for extra in (["--tokens", "300", "--dtype", "bf16"], ["--tokens", "129", "--dtype", "f16", "--seed", "1"],
                      ["--tokens", "129", "--blocking"]):
            cmd = [sys.executable, EXAMPLE, "--target", server.target] + extra
            print("+ " + " ".join(cmd), flush=True)
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240, text=True)
            print(proc.stdout, flush=True)
            if proc.returncode != 0 or "OK" not in proc.stdout.splitlines()[-1]:
                print("example failed with status %d; server log:\n%s" % (proc.returncode, server.log_text()[-4000:]))
                return 1
        with mlakv.Client(server.target, timeout=30) as c:
            pool = c.pool()
            if pool.pages_free != pool.pages_total or pool.sequences != 0:
                print("pool not empty after the example: %s" % pool)
                return 1
    if server.returncode != 0:
        print("mlakv-server exited with %s on SIGTERM" % server.returncode)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
