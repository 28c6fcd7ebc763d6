"""docker-compose.yml and the Dockerfile: validated with docker-compose's client where it is installed."""

import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT

COMPOSE = shutil.which("docker-compose")


def compose_config(*args: str) -> dict:
    out = subprocess.run([COMPOSE, *args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.skipif(
    COMPOSE is None, reason="docker-compose client not installed (apt-get install docker-compose)"
)
def test_compose_file_is_valid_and_wires_export_api_gpu_and_ray():
    cfg = compose_config("--profile", "gpu", "--profile", "ray")
    services = cfg["services"]
    assert set(services) == {"export", "export-int8", "api", "proxy", "api-gpu", "ray"}
    assert services["proxy"]["build"]["target"] == "proxy" and services["proxy"]["depends_on"] == {
        "api": {"condition": "service_started"}
    }
    assert any(p.startswith("127.0.0.1:8080:8080") for p in services["proxy"]["ports"])
    assert services["export"]["build"]["target"] == "export"
    assert "artifacts" in cfg["volumes"]
    for name in ("api", "api-gpu", "ray"):
        svc = services[name]
        for export in ("export", "export-int8"):
            assert svc["depends_on"][export]["condition"] == "service_completed_successfully"
        assert "/app/healthcheck.py" in " ".join(svc["healthcheck"]["test"])  # follows the port (issue 27)
        assert name == "ray" or "8000" not in " ".join(svc["healthcheck"]["test"])  # Ray's proxy: fixed 8000
        assert any(":ro" in str(v) or (isinstance(v, dict) and v.get("read_only")) for v in svc["volumes"])
    assert services["api"]["environment"]["ADDNORM_PROVIDERS"] == "cpu"
    # Two models from one volume (fp32 and int8, under their own names), HTTP and gRPC, both on loopback only
    assert (
        "--variant" in services["export-int8"]["command"]
        and "encoder-int8" in services["export-int8"]["command"]
    )
    for name, ports in (
        ("api", ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001"]),
        ("api-gpu", ["127.0.0.1:8010:8000", "127.0.0.1:8011:8001"]),
    ):
        env = services[name]["environment"]
        assert env["ADDNORM_MODEL_REPOSITORY"] == "/artifacts" and env["ADDNORM_GRPC_PORT"] == "8001"
        assert [str(p).removesuffix("/tcp") for p in services[name]["ports"]] == ports
    for name in (
        "api",
        "api-gpu",
        "ray",
    ):  # the key comes from a secret file, never from the compose file itself
        svc = services[name]
        assert svc["environment"]["ADDNORM_API_KEY_FILE"] == "/run/secrets/addnorm_api_key"
        assert [s["source"] if isinstance(s, dict) else s for s in svc["secrets"]] == ["addnorm_api_key"]
        assert "ADDNORM_API_KEY" not in svc["environment"]
    assert cfg["secrets"]["addnorm_api_key"]["file"].endswith("secrets/api_key")
    gpu = services["api-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["ADDNORM_PROVIDERS"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    ray = services["ray"]
    assert ray["profiles"] == ["ray"] and ray["build"]["target"] == "ray"
    assert ray["command"][:3] == ["serve", "run", "addnorm.service.ray_serve:build"]
    assert "artifact=" + ray["environment"]["ADDNORM_ARTIFACT"] in ray["command"]
    assert [str(p).removesuffix("/tcp") for p in ray["ports"]] == ["127.0.0.1:8002:8000"]  # loopback only
    # as locked down as deploy/k8s: no capabilities, no escalation, read-only root (Ray too: its files go to /tmp)
    for name, svc in services.items():
        assert svc["cap_drop"] == ["ALL"] and "no-new-privileges:true" in svc["security_opt"], name
        assert svc["read_only"] is True and "/tmp" in svc["tmpfs"], name
        assert svc["ulimits"]["nofile"]["hard"] <= 20000, name  # what a VM without CAP_SYS_RESOURCE allows


def test_dockerfile_targets_keep_torch_out_of_the_serving_images():
    stages = _stages()
    assert {"base", "export", "api", "api-gpu", "ray"} <= set(stages)
    for serving in ("api", "api-gpu", "ray"):
        body = "\n".join(stages[serving])
        assert "torch" not in body.replace("find_spec('torch') is None", "")
        assert "USER addnorm" in body and "HEALTHCHECK" in body
    assert "onnxruntime-gpu" in "\n".join(stages["api-gpu"])
    assert "download.pytorch.org/whl/cpu" in "\n".join(stages["export"])  # never the CUDA build of torch


def _stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip()
            stages[current] = []
        elif current:
            stages[current].append(line)
    return stages


def test_dockerfile_installs_dependencies_before_the_source_and_onnxruntime_gpu_once():
    """Issue 27: the source was copied before pip install, so a code edit reinstalled torch; api-gpu fetched
    onnxruntime-gpu twice (once with the CPU build it then removed)."""
    stages = _stages()
    for name in ("export", "api", "ray", "api-gpu"):
        body = stages[name]
        deps = next(i for i, line in enumerate(body) if "requirements.py" in line and "python" in line)
        source = next(i for i, line in enumerate(body) if line.startswith("COPY service"))
        assert deps < source, name
        assert any("pip install --no-deps ." in line for line in body[source:]), name
        assert all(
            "--mount=type=cache" in line for line in body if line.startswith("RUN") and "pip install" in line
        )
    gpu = "\n".join(stages["api-gpu"])
    assert "--drop onnxruntime" in gpu and "uninstall" not in gpu and "--force-reinstall" not in gpu
    assert (
        "PIP_NO_CACHE_DIR" not in (ROOT / "Dockerfile").read_text()
    )  # the cache mount keeps it out of layers


def test_requirements_for_the_image_layers_come_from_pyproject():
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("requirements", ROOT / "deploy/docker/requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requirements = module.requirements

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = requirements(ROOT / "pyproject.toml", [], [])
    assert base == project["dependencies"]
    gpu = requirements(ROOT / "pyproject.toml", ["gpu"], ["onnxruntime"])
    assert not any(r.startswith("onnxruntime>") or r == "onnxruntime" for r in gpu)
    assert any(r.startswith("onnxruntime-gpu") for r in gpu)
    assert any(r.startswith("torch==") for r in requirements(ROOT / "pyproject.toml", ["export"], []))
    with pytest.raises(SystemExit, match="no extra"):
        requirements(ROOT / "pyproject.toml", ["nope"], [])


HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"


def _healthcheck():
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_healthcheck_loads_neither_onnxruntime_nor_fastapi():
    """The containers run it every 10 s: the standard library only (importing onnxruntime and FastAPI took 0.5 s
    of CPU per check), and every serving image copies it where its HEALTHCHECK runs it."""
    import subprocess
    import sys

    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1]); "
        "print(sorted({'onnxruntime', 'fastapi', 'numpy', 'service'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(HEALTHCHECK)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
    dockerfile = (ROOT / "Dockerfile").read_text()
    # the proxy image is the api image's child (FROM api): it has the healthcheck already
    assert (
        dockerfile.count("COPY deploy/docker/healthcheck.py ./") == 3
        and dockerfile.count("HEALTHCHECK ") == 4
    )
    assert "FROM api AS proxy" in dockerfile


def test_the_healthcheck_follows_the_port(server, monkeypatch):
    healthcheck = _healthcheck()

    port = server.rsplit(":", 1)[1]
    assert healthcheck.main([port]) == 0
    monkeypatch.setenv("ADDNORM_PORT", port)
    assert healthcheck.main([]) == 0
    from bench.server import free_port

    assert healthcheck.main([str(free_port())]) == 1  # nothing there
