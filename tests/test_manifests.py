"""deploy/: the Ray Serve config, the KubeRay RayService, the Kubernetes and KServe manifests.

Each is parsed and checked against what the code really serves: route paths from the app, setting names from
Settings, ports from the settings' default, image names from the compose file. A renamed route, setting or image
fails here. No cluster runs here; Ray's own schema validates the Serve configs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from addnorm.service.front.app import create_app
from addnorm.service.ray_serve import DEPLOYMENT, build
from addnorm.service.settings import Settings
from tests.conftest import ROOT
from tests.service.test_guard import served_routes

DEPLOY = ROOT / "deploy"
SETTING_VARS = {f"ADDNORM_{name.upper()}" for name in Settings.model_fields}
ROUTES = {path for method, path in served_routes(create_app(Settings())) if method == "GET"}
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
COMPOSE_IMAGES = {svc["image"] for svc in COMPOSE["services"].values()}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in docs(path)}


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def check_env_names(container: dict) -> None:
    names = {n for n in env(container) if n.startswith("ADDNORM_")}
    assert names <= SETTING_VARS, f"{container['name']}: no such setting {sorted(names - SETTING_VARS)}"


def check_probes(container: dict, ports: dict[str, int]) -> None:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            get = container[kind]["httpGet"]
            assert get["path"] in ROUTES, f"{container['name']} {kind}: {get['path']} is not a route"
            port = get["port"]
            assert ports.get(port, port) == int(env(container)["ADDNORM_PORT"])


def test_every_manifest_parses_and_names_its_kind():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 9
    for path in files:
        for doc in docs(path):
            assert path.name == "serve.yaml" or ("apiVersion" in doc and "kind" in doc), path


@pytest.mark.parametrize("source", ["serve.yaml", "rayservice.yaml"])
def test_serve_configs_pass_rays_schema_and_our_builder(source, monkeypatch):
    if source == "serve.yaml":
        config = yaml.safe_load((DEPLOY / "ray" / source).read_text())
    else:
        config = yaml.safe_load(by_kind(DEPLOY / "ray" / source)["RayService"]["spec"]["serveConfigV2"])
    schema = (
        ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else None
    )
    assert schema is not None and len(schema.applications) == 1
    app = config["applications"][0]
    module, _, func = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), func) is build
    build(dict(app["args"]))  # the builder accepts its arguments
    assert [d["name"] for d in app["deployments"]] == [DEPLOYMENT]
    assert set(app["runtime_env"]["env_vars"]) <= SETTING_VARS


def test_rayservice_mounts_what_its_serve_config_reads():
    rs = by_kind(DEPLOY / "ray" / "rayservice.yaml")["RayService"]
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    cluster = rs["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    ]
    key_dir = str(Path(app["runtime_env"]["env_vars"]["ADDNORM_API_KEY_FILE"]).parent)
    for pod in pods:
        for c in pod["containers"]:
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert str(Path(app["args"]["artifact"]).parent) in mounts and key_dir in mounts
            assert c["image"] == COMPOSE["services"]["ray"]["image"]


def test_k8s_api_deployment_matches_the_app_settings_and_compose():
    kinds = by_kind(DEPLOY / "k8s" / "api.yaml")
    dep, svc = kinds["Deployment"], kinds["Service"]
    pod = dep["spec"]["template"]["spec"]
    (api,) = pod["containers"]
    assert api["image"] == COMPOSE["services"]["api"]["image"]
    check_env_names(api)
    ports = {p["name"]: p["containerPort"] for p in api["ports"]}
    assert ports == {"http": Settings.model_fields["port"].default}
    check_probes(api, ports)
    assert api["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert api["livenessProbe"]["httpGet"]["path"] == "/health/live"
    # non-root, read-only root filesystem, requests and limits
    assert pod["securityContext"]["runAsNonRoot"] and api["securityContext"]["readOnlyRootFilesystem"]
    assert {"cpu", "memory"} <= set(api["resources"]["requests"]) & set(api["resources"]["limits"])
    # the API key comes from a Secret mounted where ADDNORM_API_KEY_FILE points
    mounts = {m["name"]: m["mountPath"] for m in api["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    key_file = Path(env(api)["ADDNORM_API_KEY_FILE"])
    (secret,) = [n for n, v in volumes.items() if "secret" in v]
    assert key_file.parent == Path(mounts[secret])
    assert env(api)["ADDNORM_ARTIFACT"].startswith(mounts["artifacts"])
    # the Service reaches the container's port; selectors match
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    assert svc["spec"]["selector"].items() <= pod_labels(dep).items()
    hpa = by_kind(DEPLOY / "k8s" / "hpa.yaml")["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]


def pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


def test_export_job_runs_the_compose_export_and_writes_the_triton_repository():
    job = by_kind(DEPLOY / "k8s" / "export-job.yaml")["Job"]
    pod = job["spec"]["template"]["spec"]
    (export,) = pod["initContainers"]
    (triton,) = pod["containers"]
    assert export["image"] == COMPOSE["services"]["export"]["image"]
    assert export["args"] == COMPOSE["services"]["export"]["command"]
    assert triton["image"] == COMPOSE["services"]["api"]["image"]
    scripts = (ROOT / "pyproject.toml").read_text()
    assert f'{triton["command"][0]} = "addnorm.commands:triton_main"' in scripts
    kustomize = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kustomize["resources"]) == sorted(
        p.name for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml"
    )
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {
        by_kind(DEPLOY / "k8s" / "artifacts-pvc.yaml")["PersistentVolumeClaim"]["metadata"]["name"]
    }
    # deploy/kserve/triton.yaml reads the repository this Job writes
    triton_isvc = by_kind(DEPLOY / "kserve" / "triton.yaml")["InferenceService"]
    command = triton["command"]
    repo = command[command.index("--model-repository") + 1].removeprefix("/artifacts/")
    assert triton_isvc["spec"]["predictor"]["model"]["storageUri"] == f"pvc://{next(iter(claims))}/{repo}"


def test_kserve_runtime_speaks_v2_on_its_declared_port():
    runtime = by_kind(DEPLOY / "kserve" / "serving-runtime.yaml")["ServingRuntime"]
    isvc = by_kind(DEPLOY / "kserve" / "inferenceservice.yaml")["InferenceService"]
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == "v2" and model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    (c,) = runtime["spec"]["containers"]
    assert c["image"] in COMPOSE_IMAGES
    check_env_names(c)
    assert [p["containerPort"] for p in c["ports"]] == [int(env(c)["ADDNORM_PORT"])]
    check_probes(c, {})
    assert c["readinessProbe"]["httpGet"]["path"].startswith("/v2/")
