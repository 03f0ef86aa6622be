#!/usr/bin/env python3
"""The rooms' one-way rule (docs/architecture.md), checked three ways.

1. The CMake target graph (`cmake --graphviz` of a fresh configure): every
   edge between the project's libraries is one the table below allows, so no
   edge points back up (core never links rpc, kernels never link the server).
2. The compiler: a file compiled with a room's own flags (from the build's
   compile_commands.json) can include that room's headers and those of the
   rooms it links, and fails to find the header of a room it may not see.
3. Headers outside the project that the rooms do not control with include
   paths (gRPC, protobuf, the CUDA runtime are all in /usr/include or CUDA's
   include folder, visible to everyone): no source of a room includes the
   ones its rule forbids.

Environment: MLAKV_SOURCE_DIR, MLAKV_BUILD_DIR (for compile_commands.json).
"""
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.environ["MLAKV_SOURCE_DIR"]
BUILD = os.environ["MLAKV_BUILD_DIR"]

# Library -> the project libraries it may link directly. Lower rooms first.
ALLOWED = {
    "mlakv_common": set(),
    "mlakv_proto": set(),
    "mlakv_kernels": {"mlakv_common"},
    "mlakv_safetensors": {"mlakv_common"},
    "mlakv_backend": {"mlakv_kernels", "mlakv_common"},
    "mlakv_core": {"mlakv_backend", "mlakv_common"},
    "mlakv_regions": {"mlakv_core", "mlakv_backend", "mlakv_kernels", "mlakv_common"},
    "mlakv_security": {"mlakv_common"},
    # Calls on gRPC's completion-queue API, and health / reflection on it.
    "mlakv_cq": {"mlakv_proto", "mlakv_common"},
    # The proto only for the service's method names (bounded metric labels).
    "mlakv_observability": {"mlakv_core", "mlakv_backend", "mlakv_cq", "mlakv_proto", "mlakv_common"},
    # KV events on ZeroMQ in vLLM's format: the core's event log only.
    "mlakv_events": {"mlakv_core", "mlakv_backend", "mlakv_common"},
    "mlakv_rpc": {"mlakv_core", "mlakv_backend", "mlakv_regions", "mlakv_observability", "mlakv_security",
                  "mlakv_events", "mlakv_cq", "mlakv_proto", "mlakv_kernels", "mlakv_common"},
    # The client speaks only the proto.
    "mlakv_client": {"mlakv_proto", "mlakv_common"},
    "mlakv_load_generator": {"mlakv_client"},
    # Many servers as one: routes calls of the proto client.
    "mlakv_fleet_client": {"mlakv_client", "mlakv_common"},
    "mlakv_rowfile": {"mlakv_safetensors", "mlakv_kernels", "mlakv_common"},
}
# Test-only libraries may link anything; nothing above may link them.
TESTING = re.compile(r"^mlakv_.*(testing|_support)$")

# Room folder -> include prefixes its sources must not use.
SERVER_ROOMS = ["server/core", "server/backend", "server/regions", "server/rpc", "server/observability",
                "server/security", "server/events", "server/cq"]
GRPC_AND_PROTO = ["grpc/", "grpcpp/", "grpc++/", "google/protobuf/", "mlakv/v1/"]
CUDA_RUNTIME = ["cuda_runtime", "cuda.h", "cuda_runtime_api.h"]
FORBIDDEN_INCLUDES = {
    "kernels": GRPC_AND_PROTO + ["server/", "client/", "spdlog/"],
    "server/core": GRPC_AND_PROTO + CUDA_RUNTIME + [r for r in SERVER_ROOMS if r not in ("server/core",
                                                                                         "server/backend")],
    "server/backend": GRPC_AND_PROTO + [r for r in SERVER_ROOMS if r != "server/backend"],
    "server/regions": GRPC_AND_PROTO + ["server/rpc", "server/observability", "server/security"],
    "server/security": ["server/core", "server/backend", "server/regions", "server/rpc", "server/observability"],
    "server/observability": ["server/rpc", "server/regions", "server/security"],
    # gRPC's API and the standard services' protos, nothing of the cache.
    "server/cq": ["mlakv/v1/", "kernels/"] + [r for r in SERVER_ROOMS if r != "server/cq"],
    "server/events": GRPC_AND_PROTO + ["server/rpc", "server/regions", "server/security", "server/observability"],
}
# The client library's own files (client/cli and the row-file helpers use kernels).
CLIENT_LIBRARY = ["client/kv_cache_client.h", "client/kv_cache_client.cc", "client/append_stream.h",
                  "client/append_wire.h", "client/append_wire.cc"]
CLIENT_FORBIDDEN = ["server/", "kernels/", "cuda"]

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


def graph_edges():
    with tempfile.TemporaryDirectory() as tmp:
        dot = os.path.join(tmp, "graph.dot")
        p = subprocess.run(["cmake", "-S", SOURCE, "-B", os.path.join(tmp, "b"), "-G", "Ninja",
                            "--graphviz=" + dot], capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise AssertionError("cmake --graphviz failed:\n" + p.stdout[-3000:] + p.stderr[-3000:])
        with open(dot) as f:
            text = f.read()
    names = dict(re.findall(r'"(node\d+)" \[ label = "([^"]+)"', text))
    edges = set()
    for a, b in re.findall(r'"(node\d+)" -> "(node\d+)"', text):
        edges.add((names[a], names[b]))
    return names.values(), edges


class TargetGraph(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.targets, cls.edges = graph_edges()

    def test_every_library_is_in_the_table(self):
        libraries = {t for t in self.targets if t.startswith("mlakv_") and not TESTING.match(t)}
        # Executables (mlakv, mlakv-server, tests, benches) are leaves: they may link any library.
        executables = {"mlakv_soak", "mlakv_e2e_test"}
        missing = sorted(libraries - set(ALLOWED) - executables)
        self.assertEqual(missing, [], "libraries without a rule in ALLOWED (add them, lowest rooms first)")

    def test_no_edge_points_up(self):
        bad = []
        for a, b in sorted(self.edges):
            if a in ALLOWED and b.startswith("mlakv") and b not in ALLOWED[a]:
                bad.append(f"{a} -> {b}")
        self.assertEqual(bad, [], "edges the one-way rule forbids")

    def test_production_never_links_test_code(self):
        bad = [f"{a} -> {b}" for a, b in sorted(self.edges)
               if (a in ALLOWED or a in ("mlakv", "mlakv-server")) and TESTING.match(b)]
        self.assertEqual(bad, [])

    def test_the_server_binary_links_only_the_rpc_room(self):
        linked = sorted(b for a, b in self.edges if a == "mlakv-server" and b.startswith("mlakv"))
        self.assertEqual(linked, ["mlakv_rpc"])


def compile_command_of(source):
    with open(os.path.join(BUILD, "compile_commands.json")) as f:
        for entry in json.load(f):
            if os.path.realpath(entry["file"]) == os.path.realpath(os.path.join(SOURCE, source)):
                return entry
    raise AssertionError(f"{source} is not in compile_commands.json")


def try_compile(room_source, include):
    """Compiles `#include "<include>"` with the flags of room_source."""
    entry = compile_command_of(room_source)
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.cc")
        with open(probe, "w") as f:
            f.write(f'#include "{include}"\n')
        out = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a in ("-o", "-MF", "-MT", "-c"):
                skip = True
                continue
            if a in ("-MD",) or os.path.realpath(a) == os.path.realpath(entry["file"]):
                continue
            out.append(a)
        # Preprocess only: whether the header is found is the question.
        p = subprocess.run(out + ["-E", "-o", os.devnull, probe], cwd=entry["directory"], capture_output=True,
                           text=True, timeout=300)
        return p.returncode == 0, p.stderr


class IncludePaths(unittest.TestCase):
    # (a source of the room, a header it may include, a header it may not)
    CASES = [
        ("server/core/pool.cc", "server/backend/cache_backend.h", "server/rpc/kv_cache_service.h"),
        ("server/core/pool.cc", "server/core/sequence_table.h", "server/regions/region_registry.h"),
        ("server/backend/cpu_backend.cc", "kernels/quantize_append.h", "server/core/pool.h"),
        ("server/regions/shm_region.cc", "server/core/pool.h", "server/observability/server_metrics.h"),
        ("server/security/bearer_token_auth.cc", "common/quote.h", "server/core/pool.h"),
        ("server/cq/calls.cc", "common/tsan_annotations.h", "server/rpc/kv_cache_service.h"),
        ("server/observability/server_metrics.cc", "server/core/pool.h", "server/rpc/grpc_status.h"),
        ("client/kv_cache_client.cc", "mlakv/v1/kv_cache.pb.h", "kernels/quantize_append.h"),
        ("kernels/quantize_append_cpu.cc", "common/status_macros.h", "server/backend/device.h"),
    ]

    def test_a_room_sees_what_it_links_and_nothing_above(self):
        for source, allowed, forbidden in self.CASES:
            with self.subTest(source=source):
                ok, err = try_compile(source, allowed)
                self.assertTrue(ok, f"{source} should see {allowed}:\n{err[-2000:]}")
                ok, err = try_compile(source, forbidden)
                self.assertFalse(ok, f"{source} must not see {forbidden}")
                # gcc says "No such file or directory", clang "file not found":
                # either way the failure must be the missing header, not a typo.
                self.assertRegex(err, r"No such file|file not found")
                self.assertIn(forbidden, err)


class ForbiddenIncludes(unittest.TestCase):
    def sources(self, folder):
        root = os.path.join(SOURCE, folder)
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith((".h", ".cc", ".cu", ".cuh")):
                    yield os.path.relpath(os.path.join(dirpath, name), SOURCE)

    def check(self, files, forbidden):
        bad = []
        for rel in files:
            with open(os.path.join(SOURCE, rel), encoding="utf-8") as f:
                text = f.read()
            for inc in INCLUDE.findall(text):
                if any(inc.startswith(f) or inc == f for f in forbidden):
                    bad.append(f"{rel}: #include {inc}")
        return bad

    def test_rooms_include_only_what_their_rule_allows(self):
        bad = []
        for folder, forbidden in FORBIDDEN_INCLUDES.items():
            files = list(self.sources(folder))
            self.assertTrue(files, folder)
            bad += self.check(files, forbidden)
        bad += self.check(CLIENT_LIBRARY, CLIENT_FORBIDDEN)
        self.assertEqual(bad, [])

    def test_the_check_sees_a_forbidden_include(self):
        # The scanner itself: a line it must flag.
        self.assertEqual(INCLUDE.findall('#include <grpcpp/grpcpp.h>\n  # include "server/rpc/x.h"\n'),
                         ["grpcpp/grpcpp.h", "server/rpc/x.h"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
