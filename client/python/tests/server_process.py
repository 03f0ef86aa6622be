"""A real mlakv-server process on a loopback port it picks itself, for tests and examples.

    with ServerProcess() as server:          # binary from $MLAKV_SERVER
        client = mlakv.Client(server.target)

Starts `mlakv-server --listen 127.0.0.1:0 --device cpu [extra args]` and reads
the port the server bound from its start-up line ("... ready: grpc
127.0.0.1:PORT ..."), so no other process can take the port between a pick
and the bind. Waits until grpc.health.v1 says SERVING (bounded), and always
stops the server (SIGTERM, then SIGKILL after a grace period), also at
interpreter exit.
"""

import atexit
import os
import re
import signal
import subprocess
import tempfile
import time

import mlakv

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


class ServerProcess:
    def __init__(self, *extra_args, binary=None, device="cpu", credentials=None, host="127.0.0.1", port=0):
        self.binary = binary or os.environ.get("MLAKV_SERVER")
        if not self.binary:
            raise RuntimeError("MLAKV_SERVER is not set (path of the mlakv-server binary)")
        if not os.access(self.binary, os.X_OK):
            raise RuntimeError("MLAKV_SERVER=%s is not an executable (build target mlakv-server)" % self.binary)
        self.args = list(extra_args)
        self.device = device
        self.credentials = credentials  # grpc.ChannelCredentials when the server serves TLS
        self.proc = None
        self.host = host  # a loopback address (127.0.0.2 ... for fleets)
        self.listen_port = port  # 0: the server picks one
        self.port = None
        self.log = None

    @property
    def target(self):
        return "%s:%d" % (self.host, self.port)

    def metrics_port(self):
        """The port of --metrics_listen (port 0 picks one), from the start-up line."""
        m = re.search(r" ready: .*metrics port (\d+)", self.log_text())
        if not m:
            raise RuntimeError("no metrics port in the server's start-up line (--metrics_listen not given?)")
        return int(m.group(1))

    def kv_events_endpoints(self):
        """(PUB endpoint, replay endpoint or None) of --kv_events_endpoint / --kv_events_replay_endpoint
        as bound (a port * picks one), from the start-up line."""
        m = re.search(r" ready: .*, kv events (\S+)(?: replay (\S+))?, pools ", self.log_text())
        if not m or m.group(1) == "off":
            raise RuntimeError("no kv events endpoint in the server's start-up line (--kv_events_endpoint not given?)")
        return m.group(1), m.group(2)

    def log_text(self):
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def start(self):
        self.port = None  # a restarted server binds a new port
        self.log = tempfile.NamedTemporaryFile(prefix="mlakv-server-", suffix=".log", delete=False)
        cmd = [self.binary, "--listen", "%s:%d" % (self.host, self.listen_port), "--device", self.device] + self.args
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        if self._wait_serving():
            return self
        last = self.log_text()
        self.stop()
        os.unlink(self.log.name)
        self.log = None
        raise RuntimeError("mlakv-server did not become SERVING; log:\n" + last[-4000:])

    def _wait_serving(self):
        # A fresh channel per try: one channel that failed to connect would
        # wait out gRPC's reconnect backoff (1 s, 1.6 s, 2.6 s, ...) between tries.
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.port is None:
                m = re.search(r" ready: grpc %s:(\d+) .*\n" % re.escape(self.host), self.log_text())
                if m:
                    self.port = int(m.group(1))
            if self.port is not None:
                with mlakv.Client(self.target, credentials=self.credentials, timeout=1.0) as client:
                    try:
                        if client.health() == "SERVING":
                            return True
                    except mlakv.Error:
                        pass
            time.sleep(0.05)
        return False

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        self.proc = None
        if self.log is not None:
            self.log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        if self.log is not None:
            try:
                os.unlink(self.log.name)
            except OSError:
                pass
