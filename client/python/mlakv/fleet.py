"""mlakv.Fleet: many mlakv servers (one per GPU) used as one.

    fleet = mlakv.Fleet(servers=["10.0.0.5:50051", "10.0.0.6:50051"])
    fleet = mlakv.Fleet(service="dns:///mlakv.kv.svc.cluster.local:50051")
    fleet.append("req-1", layer=0, ckv=ckv, kpe=kpe)   # on the server placement picks
    fleet.sequence("req-1").server_id                  # the same server
    fleet.pools()                                      # every server's pools

The same placement as the C++ FleetClient (client/fleet_client.h), bit for
bit (docs/deploy.md "Placement"):
  1. the server_id the caller passes (server_id=...);
  2. the server this client last saw the sequence on (recorded when a call
     for it succeeded; forgotten when it is freed or its owner answers
     NOT_FOUND), so a sequence stays where it was created after servers join;
  3. rendezvous hashing of the sequence id over the servers' addresses
     (weight() below). If the first choice is unhealthy the call goes to the
     best healthy server; a NOT_FOUND there becomes UNAVAILABLE naming the
     first choice.
A server answering UNAVAILABLE is marked unhealthy: calls for the sequences
it owns then fail at once with Error(UNAVAILABLE) naming it, and it takes no
new sequences until a probe (health check + ListPools, every
refresh_interval seconds in a background thread, or refresh()) finds it
serving. Nothing is retried elsewhere: a sequence's pages live on one GPU.
"""

import socket
import threading
from typing import Any, Callable, List, Optional, Tuple, Union

import grpc

from mlakv.client import Client
from mlakv.errors import Error

_M64 = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a of bytes (offset 0xcbf29ce484222325, prime 0x100000001b3)."""
    h = 0xCBF29CE484222325
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & _M64
    return h


def mix64(x: int) -> int:
    """splitmix64's finalizer."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return x


def _bytes(s):
    return s.encode() if isinstance(s, str) else bytes(s)


def weight(sequence: Union[str, bytes], server_key: Union[str, bytes]) -> int:
    """Rendezvous weight of a sequence id on a server key: mix64(fnv1a64(key) ^ mix64(fnv1a64(id)))."""
    return mix64(fnv1a64(_bytes(server_key)) ^ mix64(fnv1a64(_bytes(sequence))))


def pick(sequence: Union[str, bytes], keys: List[str]) -> Optional[str]:
    """The key that wins `sequence` (highest weight; ties to the larger key); None for no keys."""
    best, best_w = None, -1
    for k in keys:
        w = weight(sequence, k)
        if w > best_w or (w == best_w and _bytes(k) > _bytes(best)):
            best, best_w = k, w
    return best


def parse_service(target: str) -> Tuple[str, int]:
    """'dns:///NAME:PORT' -> (NAME, PORT)."""
    prefix = "dns:///"
    if not target.startswith(prefix):
        raise ValueError("service %r is not dns:///NAME:PORT" % (target[:200],))
    host, sep, port = target[len(prefix):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("service %r is not dns:///NAME:PORT (port 1..65535)" % (target[:200],))
    return host, int(port)


def system_resolver(name: str) -> List[str]:
    """getaddrinfo: every A/AAAA address of `name`, deduplicated, in order."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise Error(grpc.StatusCode.UNAVAILABLE, "resolving %r: %s" % (name[:200], err)) from None
    out = []
    for info in infos:
        ip = info[4][0]
        if ip not in out:
            out.append(ip)
    return out


def _join(ip, port):
    return "[%s]:%d" % (ip, port) if ":" in ip and not ip.startswith("[") else "%s:%d" % (ip, port)


class _FleetSave:
    """A LayerwiseSave on one server of a Fleet: layer() as the save's; wait()
    records the owner once the save committed, names the server on UNAVAILABLE."""

    def __init__(self, fleet, server, sequence, save):
        self._fleet, self._server, self._sequence, self._save = fleet, server, sequence, save

    def layer(self, *args: Any, **kwargs: Any) -> None:
        self._save.layer(*args, **kwargs)

    def done(self) -> bool:
        return self._save.done()

    def wait(self) -> Any:
        try:
            result = self._save.wait()
        except Error as err:
            raise self._fleet._settled(self._server, self._sequence, err) from None
        self._fleet._record(self._sequence, self._server)
        return result

    def __enter__(self) -> "_FleetSave":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._save.__exit__(exc_type, exc, tb)
            return False
        self.wait()
        return False


class FromEach:
    """Answers of every server to a call that names no sequence: answers maps
    server_id -> value; failures lists an Error per server that failed."""

    def __init__(self):
        self.answers = {}
        self.failures = []


class _Server:
    def __init__(self, address, client):
        self.address = address
        self.client = client
        self.server_id = ""
        self.healthy = False
        self.last_error = "not probed yet"

    def describe(self):
        if not self.server_id or self.server_id == self.address:
            return "server %s" % self.address
        return "server %s (%s)" % (self.server_id, self.address)


class Fleet:
    """A set of servers: servers=[host:port, ...] or service="dns:///NAME:PORT".

    resolver: name -> list of IP strings (default getaddrinfo); injectable for
      tests. refresh_interval: seconds between re-resolving and probing every
      server in a background thread (0: only on refresh()). probe_timeout:
      seconds per probe. Other keyword arguments go to every mlakv.Client
      (token, timeout, credentials, ...).
    """

    def __init__(self, servers: Optional[List[str]] = None, service: Optional[str] = None, *,
                 resolver: Optional[Callable[[str], List[str]]] = None, refresh_interval: float = 5.0,
                 probe_timeout: float = 2.0, max_recorded_owners: int = 1 << 20, **client_kwargs: Any) -> None:
        if bool(servers) == bool(service):
            raise ValueError("give servers=[...] or service='dns:///NAME:PORT', one of them")
        self._static = list(servers) if servers else None
        if self._static is not None and len(set(self._static)) != len(self._static):
            raise ValueError("servers names a server twice")
        self._dns = parse_service(service) if service else None
        self._resolver = resolver or system_resolver
        self._probe_timeout = probe_timeout
        self._max_owners = max_recorded_owners
        options = list(client_kwargs.pop("options", ()))
        # Short reconnect backoff: a server that comes back is seen by the next probe.
        options += [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        self._client_kwargs = dict(client_kwargs, options=options)
        self._lock = threading.Lock()
        self._servers = {}  # address -> _Server
        self._owners = {}  # sequence -> address
        self._stop = threading.Event()
        self.refresh()
        self._thread = None
        if refresh_interval > 0:
            self._thread = threading.Thread(target=self._loop, args=(refresh_interval,), daemon=True,
                                            name="mlakv-fleet-refresh")
            self._thread.start()

    # -- membership -------------------------------------------------------

    def _addresses(self):
        if self._static is not None:
            return self._static
        name, port = self._dns
        return [_join(ip, port) for ip in self._resolver(name)]

    def refresh(self) -> None:
        """Re-resolves the name (a failed lookup keeps the servers known) and probes every server."""
        try:
            addresses = self._addresses()
        except Error:
            addresses = None
        with self._lock:
            if addresses is not None:
                for address in addresses:
                    if address not in self._servers:
                        self._servers[address] = _Server(address, Client(address, **self._client_kwargs))
                for address in [a for a in self._servers if a not in addresses]:
                    gone = self._servers.pop(address)
                    gone.client.close()
                    # A server gone from the name's records takes its sequences with it.
                    self._owners = {s: a for s, a in self._owners.items() if a != address}
            servers = list(self._servers.values())
        threads = [threading.Thread(target=self._probe, args=(s,)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _probe(self, server):
        try:
            status = server.client.health(timeout=self._probe_timeout)
            if status != "SERVING":
                raise Error(grpc.StatusCode.UNAVAILABLE, "health status " + status)
            pools = server.client.pools(timeout=self._probe_timeout)
        except Error as err:
            with self._lock:
                server.healthy, server.last_error = False, err.message
            return
        with self._lock:
            # Every pool carries the server's id; one without is known by its address.
            server.server_id = pools[0].server_id if pools and pools[0].server_id else server.address
            server.healthy, server.last_error = True, ""

    def _loop(self, interval):
        while not self._stop.wait(interval):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for server in self._servers.values():
                server.client.close()
            self._servers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def servers(self) -> List[Tuple[str, str, bool, str]]:
        """[(address, server_id, healthy, last_error)] sorted by address."""
        with self._lock:
            return sorted((s.address, s.server_id, s.healthy, s.last_error) for s in self._servers.values())

    def owner_of(self, sequence: str) -> Optional[str]:
        """The server_id this client recorded for `sequence`, or None."""
        with self._lock:
            address = self._owners.get(sequence)
            server = self._servers.get(address) if address else None
            return server.server_id if server else None

    # -- placement --------------------------------------------------------

    def route(self, sequence, server_id=None):
        """(server, first_choice_down): where a call for `sequence` goes now."""
        with self._lock:
            if server_id:
                for s in self._servers.values():
                    if s.server_id == server_id:
                        return self._usable(s, sequence), ""
                raise Error(grpc.StatusCode.NOT_FOUND, "fleet: no server has server_id %r (%d known)"
                            % (server_id[:200], len(self._servers)))
            address = self._owners.get(sequence)
            if address is not None:
                return self._usable(self._servers[address], sequence), ""
            if not self._servers:
                raise Error(grpc.StatusCode.UNAVAILABLE, "fleet: no server known (the name resolved to no address)")
            first = self._servers[pick(sequence, list(self._servers))]
            if first.healthy:
                return first, ""
            healthy = [a for a, s in self._servers.items() if s.healthy]
            if not healthy:
                why = "; ".join(sorted("%s: %s" % (s.describe(), s.last_error) for s in self._servers.values()))
                raise Error(grpc.StatusCode.UNAVAILABLE, "fleet: no server is healthy (%s)" % why)
            return (self._servers[pick(sequence, healthy)],
                    "%s is not answering: %s" % (first.describe(), first.last_error))

    @staticmethod
    def _usable(server, sequence):
        if not server.healthy:
            raise Error(grpc.StatusCode.UNAVAILABLE, "%s owns sequence %r and is not answering: %s"
                        % (server.describe(), sequence[:200], server.last_error))
        return server

    def on_sequence(self, sequence: str, call: Callable[[Client], Any], server_id: Optional[str] = None) -> Any:
        """call(client) on the server that owns `sequence`; records, forgets or marks it unhealthy."""
        server, first_choice_down = self.route(sequence, server_id)
        try:
            result = call(server.client)
        except Error as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                with self._lock:
                    if self._owners.get(sequence) == server.address:
                        del self._owners[sequence]
                if first_choice_down:
                    raise Error(grpc.StatusCode.UNAVAILABLE, "sequence %r is not on %s; placement's first "
                                "choice %s (%s)" % (sequence[:200], server.describe(), first_choice_down,
                                                    err.message)) from None
            raise self._settled(server, sequence, err) from None
        self._record(sequence, server)  # beyond max_recorded_owners the oldest goes
        return result

    # -- calls for one sequence (the mlakv.Client ones, plus server_id=) ---

    def append(self, sequence, *args, server_id=None, **kwargs):
        return self.on_sequence(sequence, lambda c: c.append(sequence, *args, **kwargs), server_id)

    def sequence(self, sequence, *args, server_id=None, **kwargs):
        return self.on_sequence(sequence, lambda c: c.sequence(sequence, *args, **kwargs), server_id)

    get_sequence = sequence

    def export(self, sequence, *args, server_id=None, **kwargs):
        return self.on_sequence(sequence, lambda c: c.export(sequence, *args, **kwargs), server_id)

    def read_dequantized(self, sequence, *args, server_id=None, **kwargs):
        return self.on_sequence(sequence, lambda c: c.read_dequantized(sequence, *args, **kwargs), server_id)

    def truncate(self, sequence, *args, server_id=None, **kwargs):
        return self.on_sequence(sequence, lambda c: c.truncate(sequence, *args, **kwargs), server_id)

    def acquire_lease(self, sequence, *args, server_id=None, **kwargs):
        return self.on_sequence(sequence, lambda c: c.acquire_lease(sequence, *args, **kwargs), server_id)

    def save(self, sequence: str, *args: Any, server_id: Optional[str] = None, **kwargs: Any) -> "_FleetSave":
        """A layer-wise save (Client.save) on the server that owns `sequence`;
        the owner is recorded when it commits."""
        server, first_choice_down = self.route(sequence, server_id)
        return _FleetSave(self, server, sequence, server.client.save(sequence, *args, **kwargs))

    def _settled(self, server, sequence, err):
        """A failed call's error as the caller sees it: UNAVAILABLE marks the
        server unhealthy and names it."""
        with self._lock:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                server.healthy, server.last_error = False, err.message
                return Error(err.code, "%s: %s" % (server.describe(), err.message))
        return err

    def _record(self, sequence, server):
        with self._lock:
            if sequence not in self._owners and len(self._owners) >= self._max_owners:
                self._owners.pop(next(iter(self._owners)))
            self._owners[sequence] = server.address

    def free_sequence(self, sequence, *args, server_id=None, **kwargs):
        result = self.on_sequence(sequence, lambda c: c.free_sequence(sequence, *args, **kwargs), server_id)
        with self._lock:
            self._owners.pop(sequence, None)
        return result

    def free(self, sequence, *args, server_id=None, **kwargs):
        return self.free_sequence(sequence, *args, server_id=server_id, **kwargs).pages_freed

    def fork_sequence(self, source, target, *args, server_id=None, **kwargs):
        """Forks on the source's server (the fork shares its pages); the target is recorded there."""
        result = self.on_sequence(source, lambda c: c.fork_sequence(source, target, *args, **kwargs), server_id)
        with self._lock:
            address = self._owners.get(source)
            if address is not None:
                self._owners[target] = address
        return result

    # -- calls that name no sequence: every healthy server -----------------

    def _each(self, call):
        out = FromEach()
        with self._lock:
            servers = sorted((s for s in self._servers.values()), key=lambda s: s.address)
            for s in servers:
                if not s.healthy:
                    out.failures.append(Error(grpc.StatusCode.UNAVAILABLE,
                                              "%s is not answering: %s" % (s.describe(), s.last_error)))
            servers = [s for s in servers if s.healthy]
        results = [None] * len(servers)

        def run(i):
            try:
                results[i] = (True, call(servers[i].client))
            except Error as err:
                results[i] = (False, err)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(servers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for server, (ok, value) in zip(servers, results):
            if ok:
                out.answers[server.server_id] = value
                continue
            settled = self._settled(server, "", value)  # UNAVAILABLE: marked, and named
            out.failures.append(settled if settled is not value else
                                Error(value.code, "%s: %s" % (server.describe(), value.message)))
        return out

    def pools(self) -> FromEach:
        """FromEach: server_id -> that server's pools (each pool carries its server_id)."""
        return self._each(lambda c: c.pools())

    def sequences(self, pool: str = "", page_size: int = 0) -> FromEach:
        """FromEach: server_id -> that server's sequences of `pool`."""
        return self._each(lambda c: c.sequences(pool, page_size))
