#!/usr/bin/python3
"""Renders every kustomization under deploy/ with `kubectl kustomize` and checks
the objects as an operator would read them: kinds, GPU resources, gRPC probes
on ports the container exposes, the config ConfigMap mounted where --config
points, metrics port and scrape annotations agreeing, non-root security
context, a headless Service whose selector picks the pods, TLS files mounted
where the TLS flags point, probes off the TLS port, ServiceMonitor and
PrometheusRule consistent with the base (rules checked by `promtool check
rules`).

  kustomize_render_test.py [--protoc PROTOC] [--server MLAKV_SERVER]

--protoc: validates the ConfigMap's server.textproto against
  mlakv.v1.ServerConfig (protoc --encode). --server: every flag the manifests
  pass must be one that mlakv-server defines (its --helpfull), and the server
  must start with the ConfigMap's config (devices moved to the CPU, caches cut
  to 64 MiB).
Fails (never skips) when kubectl, or its kustomize, is missing.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def render(path):
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True)
    if out.returncode != 0:
        failures.append(f"kubectl kustomize {path} failed: {out.stderr.strip()}")
        return []
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def flag_value(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def port_of(hostport):
    return int(hostport.rsplit(":", 1)[1])


def mounted_file(pod, container, path, where):
    """Checks that `path` is a file provided by a volume mounted in container."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(mp):
            continue
        rel = path[len(mp):]
        v = volumes.get(m["name"])
        if not check(v is not None, f"{where}: mount {m['name']} has no volume"):
            return None
        if "configMap" in v:
            return ("configMap", v["configMap"]["name"], rel)
        if "secret" in v:
            return ("secret", v["secret"]["secretName"], rel)
        if "projected" in v:
            for s in v["projected"]["sources"]:
                for kind in ("secret", "configMap"):
                    if kind in s:
                        for item in s[kind].get("items", []):
                            if item["path"] == rel:
                                return (kind, s[kind]["name"], item["key"])
            failures.append(f"{where}: {path}: no projected source provides {rel}")
            return None
        failures.append(f"{where}: {path}: volume {m['name']} is of no known kind")
        return None
    failures.append(f"{where}: {path} is not under any volumeMount")
    return None


def check_server_accepts(server_path, text, where):
    """mlakv-server starts with the shipped config (devices moved to the CPU and
    cache sizes cut to 64 MiB, since this machine has no GPU)."""
    text = re.sub(r'device: "cuda:\d+"', 'device: "cpu"', text)
    text = re.sub(r"cache_bytes: \d+", "cache_bytes: 67108864", text)
    with tempfile.NamedTemporaryFile("w", suffix=".textproto", delete=False) as f:
        f.write(text)
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([server_path, "--config", f.name, "--listen", "127.0.0.1:0"], stdout=log,
                         stderr=subprocess.STDOUT)
    ready = False
    for _ in range(400):
        log.seek(0)
        if "ready:" in log.read() or p.poll() is not None:
            break
        time.sleep(0.05)
    log.seek(0)
    out = log.read()
    ready = "ready:" in out
    if p.poll() is None:
        p.terminate()
        p.wait(20)
    os.unlink(f.name)
    check(ready, f"{where}: mlakv-server refuses the ConfigMap's config: {out.strip()}")


def check_server(objs, where, tls, protoc, server_flags, server_path=None):
    kinds = sorted(o["kind"] for o in objs)
    check(kinds == ["ConfigMap", "Deployment", "Service", "ServiceAccount"],
          f"{where}: kinds {kinds}")
    deps = by_kind(objs, "Deployment")
    svcs = by_kind(objs, "Service")
    cms = {o["metadata"]["name"]: o for o in by_kind(objs, "ConfigMap")}
    if not deps or not svcs:
        return
    dep, svc = deps[0], svcs[0]
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"].get("labels", {})
    ann = spec["template"]["metadata"].get("annotations", {})
    check(spec["selector"]["matchLabels"].items() <= labels.items(),
          f"{where}: Deployment selector does not match its pod labels")
    check(spec.get("strategy", {}).get("rollingUpdate", {}).get("maxSurge") == 0,
          f"{where}: maxSurge must be 0 (a surge pod needs a spare GPU)")
    (c,) = [c for c in pod["containers"] if c["name"] == "mlakv"]
    args = c.get("args", [])
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check(ports.get("grpc") == 50051, f"{where}: grpc containerPort {ports.get('grpc')}")
    check(ports.get("metrics") == 9090, f"{where}: metrics containerPort {ports.get('metrics')}")

    # Resources: one GPU, in limits (Kubernetes requires it there) and requests.
    res = c.get("resources", {})
    check(str(res.get("limits", {}).get("nvidia.com/gpu")) == "1", f"{where}: limits nvidia.com/gpu != 1")
    check(str(res.get("requests", {}).get("nvidia.com/gpu", "1")) == "1", f"{where}: requests nvidia.com/gpu != 1")
    for r in ("cpu", "memory"):
        check(r in res.get("requests", {}), f"{where}: no {r} request")
    check("memory" in res.get("limits", {}), f"{where}: no memory limit")

    # Probes: native gRPC, on a port the container exposes; with TLS on the
    # main port they must use the plaintext health port instead.
    probe_port = 50052 if tls else 50051
    for name in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = c.get(name)
        if not check(p and "grpc" in p, f"{where}: {name} is not a gRPC probe"):
            continue
        port = p["grpc"]["port"]
        check(port in ports.values(), f"{where}: {name} port {port} is not a containerPort")
        check(port == probe_port, f"{where}: {name} on {port}, want {probe_port}")
        check(p["grpc"].get("service", "") == "", f"{where}: {name} asks for a service other than \"\"")
    if tls:
        hl = flag_value(args, "health_listen")
        check(hl is not None and port_of(hl) == probe_port == ports.get("health"),
              f"{where}: --health_listen {hl} vs health port {ports.get('health')}")

    # Config: --config names a file of the mounted ConfigMap that this render holds.
    cfg = flag_value(args, "config")
    if check(cfg is not None, f"{where}: no --config"):
        src = mounted_file(pod, c, cfg, where)
        if src and check(src[0] == "configMap" and src[1] in cms,
                         f"{where}: --config {cfg} is not in a rendered ConfigMap ({src})"):
            text = cms[src[1]].get("data", {}).get(src[2])
            if check(text is not None, f"{where}: ConfigMap {src[1]} has no key {src[2]}") and protoc:
                enc = subprocess.run(
                    [protoc, f"--proto_path={ROOT}/proto", "--encode=mlakv.v1.ServerConfig",
                     "mlakv/v1/config.proto"], input=text.encode(), capture_output=True)
                check(enc.returncode == 0,
                      f"{where}: server.textproto is not a valid ServerConfig: {enc.stderr.decode().strip()}")
            if text is not None and server_path:
                check_server_accepts(server_path, text, where)

    # Metrics: flag, port, annotations agree.
    ml = flag_value(args, "metrics_listen")
    if check(ml is not None, f"{where}: no --metrics_listen"):
        check(port_of(ml) == ports.get("metrics"), f"{where}: --metrics_listen {ml} vs metrics port")
        check(ml.startswith("0.0.0.0:"), f"{where}: --metrics_listen {ml} not reachable from Prometheus")
    check(ann.get("prometheus.io/scrape") == "true", f"{where}: no prometheus.io/scrape annotation")
    check(ann.get("prometheus.io/port") == str(ports.get("metrics")), f"{where}: prometheus.io/port")
    check(ann.get("prometheus.io/path") == "/metrics", f"{where}: prometheus.io/path")

    # Security: non-root, no privilege escalation, read-only root, no caps.
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot not true")
    check(int(psc.get("runAsUser", 0)) != 0, f"{where}: runAsUser is root")
    check(csc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation")
    check(csc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem")
    check(csc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities not dropped")
    check(pod.get("hostIPC") is not True and pod.get("hostNetwork") is not True,
          f"{where}: hostIPC/hostNetwork in the server deployment")
    check(pod.get("terminationGracePeriodSeconds", 30) > int(flag_value(args, "drain_grace_s") or 0),
          f"{where}: terminationGracePeriodSeconds must exceed --drain_grace_s")

    # A fleet: several replicas, each naming itself by its pod name, with
    # KV events published on ports the container and the Service expose.
    check(int(spec.get("replicas", 1)) > 1, f"{where}: replicas {spec.get('replicas', 1)}, want a fleet (> 1)")
    env = {e["name"]: e for e in c.get("env", [])}
    sid = flag_value(args, "server_id")
    if check(sid is not None, f"{where}: no --server_id"):
        m = re.fullmatch(r"\$\((\w+)\)", sid)
        if check(m is not None and m.group(1) in env, f"{where}: --server_id={sid} is not an env variable"):
            check(env[m.group(1)].get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
                  f"{where}: --server_id comes from {env[m.group(1)]}, want the pod name (Downward API)")
    for flag, port_name in (("kv_events_endpoint", "kv-events"), ("kv_events_replay_endpoint", "kv-replay")):
        v = flag_value(args, flag)
        if check(v is not None, f"{where}: no --{flag}"):
            check(v.startswith("tcp://*:") and int(v.rsplit(":", 1)[1]) == ports.get(port_name),
                  f"{where}: --{flag}={v} vs containerPort {port_name} {ports.get(port_name)}")
    check(svc["spec"].get("publishNotReadyAddresses") is False,
          f"{where}: publishNotReadyAddresses must be false (clients must not place sequences on unready pods)")

    # Headless Service selecting these pods, ports naming container ports.
    check(svc["spec"].get("clusterIP") == "None", f"{where}: Service is not headless")
    check(svc["spec"]["selector"].items() <= labels.items(), f"{where}: Service selector misses the pods")
    for p in svc["spec"]["ports"]:
        check(p["targetPort"] in ports, f"{where}: Service port {p['name']} targets {p['targetPort']}")
    check({p["name"] for p in svc["spec"]["ports"]} >= {"grpc", "metrics", "kv-events", "kv-replay"},
          f"{where}: Service ports")

    # TLS: each TLS flag names a file from the expected secret key.
    tls_flags = {"tls_cert": ("mlakv-tls", "tls.crt"), "tls_key": ("mlakv-tls", "tls.key"),
                 "tls_client_ca": ("mlakv-client-ca", "ca.crt"), "auth_token_file": ("mlakv-token", "token")}
    for flag, (secret, key) in tls_flags.items():
        v = flag_value(args, flag)
        if not tls:
            check(v is None, f"{where}: base passes --{flag}")
            continue
        if check(v is not None, f"{where}: no --{flag}"):
            src = mounted_file(pod, c, v, where)
            check(src == ("secret", secret, key), f"{where}: --{flag}={v} comes from {src}, want secret {secret}/{key}")

    # Every flag must exist in mlakv-server.
    if server_flags is not None:
        for a in args:
            name = a[2:].split("=", 1)[0]
            check(name in server_flags, f"{where}: mlakv-server has no flag --{name}")


def check_ipc_example(objs, where):
    """Producer + server in one pod on one GPU: one DRA claim named by both."""
    kinds = sorted(o["kind"] for o in objs)
    check(kinds == ["ConfigMap", "Deployment", "ResourceClaimTemplate", "Service", "ServiceAccount"],
          f"{where}: kinds {kinds}")
    deps, rcts = by_kind(objs, "Deployment"), by_kind(objs, "ResourceClaimTemplate")
    if not deps or not rcts:
        return
    pod = deps[0]["spec"]["template"]["spec"]
    claims = {c["name"]: c.get("resourceClaimTemplateName") for c in pod.get("resourceClaims", [])}
    check(claims == {"gpu": rcts[0]["metadata"]["name"]}, f"{where}: pod resourceClaims {claims}")
    names = [c["name"] for c in pod["containers"]]
    check(names == ["mlakv", "producer"], f"{where}: containers {names}")
    for c in pod["containers"]:
        res = c.get("resources", {})
        check([x["name"] for x in res.get("claims", [])] == ["gpu"], f"{where}: {c['name']} does not name claim gpu")
        for part in ("limits", "requests"):
            check("nvidia.com/gpu" not in res.get(part, {}),
                  f"{where}: {c['name']} {part} nvidia.com/gpu (would be a second, different GPU)")
    check(pod.get("shareProcessNamespace") is True, f"{where}: shareProcessNamespace not true")
    check("--allow_ipc" in pod["containers"][0].get("args", []), f"{where}: the server runs without --allow_ipc")
    check(pod.get("hostIPC") is not True, f"{where}: hostIPC (not needed inside one pod)")


def check_monitoring(objs, base):
    kinds = sorted(o["kind"] for o in objs)
    check(kinds == ["PrometheusRule", "ServiceMonitor"], f"monitoring: kinds {kinds}")
    svc = by_kind(base, "Service")[0]
    for sm in by_kind(objs, "ServiceMonitor"):
        check(sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(),
              "monitoring: ServiceMonitor selector does not match the Service's labels")
        svc_ports = {p["name"] for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            check(ep["port"] in svc_ports, f"monitoring: endpoint port {ep['port']} not in Service")
            check(ep.get("path") == "/metrics", "monitoring: endpoint path")
    promtool = shutil.which("promtool")
    if not check(promtool, "monitoring: promtool not found (Debian package prometheus)"):
        return
    for rule in by_kind(objs, "PrometheusRule"):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
        out = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
        os.unlink(f.name)
        check(out.returncode == 0, f"monitoring: promtool check rules: {out.stdout}{out.stderr}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--protoc")
    ap.add_argument("--server")
    a = ap.parse_args()
    if not shutil.which("kubectl"):
        print("FAIL: kubectl not found: nothing here can render kustomize (install kubectl, which embeds kustomize)")
        return 1
    v = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True)
    if "Kustomize Version" not in v.stdout:
        print(f"FAIL: this kubectl has no embedded kustomize:\n{v.stdout}{v.stderr}")
        return 1
    print(v.stdout.strip())

    server_flags = None
    if a.server:
        h = subprocess.run([a.server, "--helpfull"], capture_output=True, text=True)
        server_flags = set(re.findall(r"^\s+--(\w+)", h.stdout + h.stderr, re.M))
        check(len(server_flags) > 5, f"could not read mlakv-server's flags from --helpfull: {h.stdout[:200]}")

    dirs = sorted(os.path.dirname(os.path.join(r, f)) for r, _, fs in os.walk(DEPLOY)
                  for f in fs if f == "kustomization.yaml")
    rendered = {}
    for d in dirs:
        rel = os.path.relpath(d, ROOT)
        rendered[rel] = render(d)
        print(f"rendered {rel}: {', '.join(o['kind'] + '/' + o['metadata']['name'] for o in rendered[rel])}")
    expected = {"deploy/base", "deploy/overlays/tls", "deploy/monitoring", "deploy/examples/ipc-pod"}
    check(expected <= set(rendered), f"missing kustomizations: {expected - set(rendered)}")
    for rel, objs in rendered.items():
        if rel == "deploy/base":
            check_server(objs, rel, False, a.protoc, server_flags, a.server)
        elif rel == "deploy/overlays/tls":
            check_server(objs, rel, True, a.protoc, server_flags, a.server)
        elif rel == "deploy/monitoring":
            if rendered.get("deploy/base"):
                check_monitoring(objs, rendered["deploy/base"])
        elif rel == "deploy/examples/ipc-pod":
            check_ipc_example(objs, rel)
        else:
            failures.append(f"{rel}: a kustomization this test does not know how to check")
    for f in failures:
        print("FAIL:", f)
    print(f"kustomize_render_test: {len(rendered)} kustomizations, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
