"""The images, built for real with podman (deploy/docker/images.sh, on a base made of Debian's packages) and run as
docker-compose.yml runs them: read-only root, tmpfs /tmp, every capability dropped, no new privileges, uid 10001,
the artifact repository mounted read-only, the API key a secret file. ``make test-images`` runs this lane (``.ci/run``
too, after installing podman and debootstrap); without podman, or not as root, it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from addnorm.model import kernels
from addnorm.model.contract import EMBEDDINGS, ENCODED
from bench.server import free_port, free_ports
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.images,
    pytest.mark.skipif(
        shutil.which("podman") is None, reason="podman is not installed (apt-get install podman)"
    ),
    pytest.mark.skipif(
        shutil.which("debootstrap") is None,
        reason="debootstrap is not installed (apt-get install debootstrap)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the images are built and run by root's podman"),
    # The first test builds the images (``images``: up to 1800 s, the base made from Debian's packages first on a
    # fresh machine): past pytest-timeout's 600 s (pyproject.toml), which killed a cold build on a busy 2-core machine.
    pytest.mark.timeout(2400),
]

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
# docker-compose.yml's x-hardened, and the ulimits this VM's runtime needs spelled out
HARDENED = [
    "--read-only",
    "--tmpfs",
    "/tmp",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--ulimit",
    "nofile=1024:4096",
    "--ulimit",
    "nproc=1024:4096",
]
KEY = "images-test-key"
API_MAX_BYTES = 400 * 1024 * 1024  # issue 39's goal for the serving image (no torch)


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def images() -> dict[str, int]:
    """The api, proxy, ray and export images built by `make images`' script (the base made first when missing);
    their sizes."""
    done = subprocess.run(
        [str(ROOT / "deploy/docker/images.sh"), "api", "proxy", "ray", "export"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sizes = {}
    for target in ("api", "proxy", "ray", "export"):
        info = json.loads(podman("image", "inspect", f"localhost/addnorm-{target}:latest").stdout)[0]
        sizes[target] = info["Size"]
    print(f"image sizes: {sizes}")
    return sizes


@pytest.fixture(scope="module")
def repository(default_artifact: Path, tmp_path_factory) -> Path:
    """A model repository holding the default artifact, readable by the image's uid 10001, and the key file."""
    root = tmp_path_factory.mktemp("images")
    shutil.copytree(default_artifact, root / "repo" / "default")
    (root / "api_key").write_text(KEY + "\n")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


class Container:
    """One container of ``image`` run hardened, as compose runs it; stopped and removed at the end."""

    def __init__(
        self,
        image: str,
        repository: Path,
        env: dict[str, str],
        ports: dict[int, int],
        options: tuple = (),
        args: tuple = (),
    ):
        self.name = f"addnorm-test-{os.getpid()}-{time.monotonic_ns()}"
        self.ports = ports  # container port -> host port
        cmd = ["run", "-d", "--name", self.name, *HARDENED, "--user", "10001", *options]
        cmd += ["-v", f"{repository / 'repo'}:/artifacts:ro"]
        cmd += ["-v", f"{repository / 'api_key'}:/run/secrets/addnorm_api_key:ro"]
        if "--network" not in options:  # in another container's network, that container publishes
            for inside, outside in ports.items():
                cmd += ["-p", f"127.0.0.1:{outside}:{inside}"]
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        self.started = time.perf_counter()
        podman(*cmd, image, *args)

    def url(self, port: int | None = None) -> str:
        return f"http://127.0.0.1:{self.ports[next(iter(self.ports)) if port is None else port]}"

    def wait_ready(self, timeout: float = 120) -> float:
        """Seconds from ``run`` (or ``start``) to the first 200 from /health/ready."""
        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            try:
                if httpx.get(f"{self.url()}/health/ready", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            state = podman("inspect", "--format", "{{.State.Status}}", self.name).stdout.strip()
            assert state == "running", f"container {state}: {self.logs()}"
            time.sleep(0.05)
        raise AssertionError(f"not ready within {timeout} s: {self.logs()}")

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return (done.stdout + done.stderr)[-4000:]

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


API_ENV = {  # docker-compose.yml's api service
    "ADDNORM_MODEL_REPOSITORY": "/artifacts",
    "ADDNORM_HOST": "0.0.0.0",
    "ADDNORM_PORT": "8000",
    "ADDNORM_GRPC_PORT": "8001",
    "ADDNORM_PROVIDERS": "cpu",
    "ADDNORM_API_KEY_FILE": "/run/secrets/addnorm_api_key",
}
AUTH = {"Authorization": f"Bearer {KEY}"}


def _readme_v1(url: str) -> np.ndarray:
    """The README's /v1 request (two rows of 0.01 x (i % 10))."""
    body = {EMBEDDINGS: [[0.01 * (i % 10) for i in range(768)]] * 2}
    r = httpx.post(f"{url}/v1/encode", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json()[ENCODED], np.float32)


def _readme_v2(url: str) -> np.ndarray:
    """The README's V2 request with tritonclient ([8, 128, 768] from seed 0, binary tensors)."""
    import tritonclient.http as th

    client = th.InferenceServerClient(url.removeprefix("http://"), network_timeout=60.0)
    x = np.random.default_rng(0).standard_normal((8, 128, 768)).astype(np.float32)
    inp = th.InferInput(EMBEDDINGS, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    try:
        # a copy: tritonclient adds its own headers to the dict it is given
        return client.infer("encoder", [inp], headers=dict(AUTH)).as_numpy(ENCODED)
    finally:
        client.close()


def _in_process(default_artifact: Path) -> tuple[np.ndarray, np.ndarray]:
    from addnorm.service.backend.engine import Engine

    engine = Engine(default_artifact, "cpu")
    v1 = np.array([[0.01 * (i % 10) for i in range(768)]] * 2, np.float32)[None]
    v2 = np.random.default_rng(0).standard_normal((8, 128, 768)).astype(np.float32)
    return engine.run(v1)[ENCODED][0], engine.run(v2)[ENCODED]


def test_the_api_image_is_small_and_holds_no_torch(images):
    assert images["api"] < API_MAX_BYTES, images
    code = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('onnxruntime') is not None)"
    run = ["run", "--rm", *HARDENED, "--user", "10001", "--entrypoint", "python"]
    done = podman(*run, "localhost/addnorm-api:latest", "-c", code)
    assert done.stdout.split() == ["None", "True"], done.stdout + done.stderr


def test_the_api_container_serves_as_compose_runs_it(images, repository, default_artifact):
    """Ready, the README's /v1 and V2 requests answered as in-process onnxruntime answers them, /metrics, the
    image's own healthcheck, a read-only root and uid 10001; then a restart answers the same."""
    want_v1, want_v2 = _in_process(default_artifact)
    c = Container(
        "localhost/addnorm-api:latest",
        repository,
        API_ENV,
        dict(zip((8000, 8001), free_ports(2), strict=True)),
    )
    try:
        ready_s = c.wait_ready()
        print(f"api: run -> ready in {ready_s:.2f} s; image {images['api'] / 1e6:.0f} MB")
        assert httpx.post(f"{c.url()}/v1/encode", json={EMBEDDINGS: [[0.0] * 768]}).status_code == 401
        got_v1, got_v2 = _readme_v1(c.url()), _readme_v2(c.url())
        np.testing.assert_allclose(got_v1, want_v1, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(got_v2, want_v2, atol=1e-5, rtol=1e-4)
        metrics = httpx.get(f"{c.url()}/metrics", headers=AUTH, timeout=10)
        assert metrics.status_code == 200 and 'addnorm_golden_verified{model="encoder"} 1.0' in metrics.text
        health = podman("healthcheck", "run", c.name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr  # the image's HEALTHCHECK, kept
        whoami = podman(
            "exec", c.name, "sh", "-c", "id -u; touch /app/x 2>&1 || echo read-only; touch /tmp/x && echo tmp"
        )
        assert (
            whoami.stdout.split("\n")[0] == "10001"
            and "read-only" in whoami.stdout
            and "tmp" in whoami.stdout
        )

        podman("restart", "-t", "20", c.name, timeout=60)
        c.started = time.perf_counter()
        print(f"api: restart -> ready in {c.wait_ready():.2f} s")
        np.testing.assert_array_equal(_readme_v1(c.url()), got_v1)
        np.testing.assert_array_equal(_readme_v2(c.url()), got_v2)
    finally:
        c.remove()


def test_sigterm_drains_the_requests_in_flight_and_exits_0(images, repository):
    """`podman stop` (SIGTERM, then SIGKILL after the grace period): four requests queued behind a two-minute batch
    delay (as long as they take to arrive: no window to miss) are all answered at once, the batchers drained when
    shutdown begins, and the server exits 0 well within the 20 s grace period."""
    env = {**API_ENV, "ADDNORM_MAX_QUEUE_DELAY_MS": "120000", "ADDNORM_MAX_BATCH_SIZE": "20"}
    c = Container(
        "localhost/addnorm-api:latest", repository, env, dict(zip((8000, 8001), free_ports(2), strict=True))
    )
    try:
        c.wait_ready()
        body = {EMBEDDINGS: [[0.1] * 768] * 4}
        with ThreadPoolExecutor(4) as pool:
            answers = [
                pool.submit(httpx.post, f"{c.url()}/v1/encode", json=body, headers=AUTH, timeout=60)
                for _ in range(4)
            ]
            deadline = time.monotonic() + 30
            while (
                'addnorm_queue_depth{model="encoder"} 4.0'
                not in httpx.get(f"{c.url()}/metrics", headers=AUTH).text
            ):
                assert time.monotonic() < deadline, "the four requests never queued"
                time.sleep(0.02)
            stop = podman("stop", "-t", "20", c.name, timeout=60)
            assert stop.returncode == 0
            assert [a.result().status_code for a in answers] == [200] * 4
        state = json.loads(podman("inspect", c.name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, c.logs()
        assert "SIGKILL" not in c.logs()
    finally:
        c.remove()


def test_the_proxy_container_fronts_the_api(images, repository, default_artifact):
    """The proxy image (Debian's nginx, its configuration written at start from the ADDNORM_* settings) in front of
    the api container, both hardened as compose runs them (the proxy in the api's network namespace, as a
    sidecar): the README's requests answered through it as in-process onnxruntime answers
    them, its own healthcheck, and the limits the two share refused by the proxy in the API's JSON shape: a body
    over ADDNORM_MAX_BODY_BYTES (413, the same setting given to both), a method HTTP does not define (405)."""
    want_v1, want_v2 = _in_process(default_artifact)
    limits = {"ADDNORM_MAX_BODY_BYTES": str(40 * 1024 * 1024)}  # above [8,128,768] in binary, below 64 MiB
    ports = dict(zip((8000, 8001, 8080), free_ports(3), strict=True))
    api = Container("localhost/addnorm-api:latest", repository, {**API_ENV, **limits}, ports)
    proxy = None
    try:
        api.wait_ready()
        # beside the api as a sidecar shares its pod: in its network namespace (the api publishes 8080)
        upstream = ("--listen", "8080", "--upstream", "127.0.0.1:8000")
        share = ("--network", f"container:{api.name}")
        proxy = Container(
            "localhost/addnorm-proxy:latest", repository, limits, {8080: ports[8080]}, share, upstream
        )
        print(f"proxy: run -> ready in {proxy.wait_ready():.2f} s; image {images['proxy'] / 1e6:.0f} MB")
        np.testing.assert_allclose(_readme_v1(proxy.url()), want_v1, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(_readme_v2(proxy.url()), want_v2, atol=1e-5, rtol=1e-4)
        health = podman("healthcheck", "run", proxy.name, check=False)
        assert health.returncode == 0, health.stdout + health.stderr
        big = httpx.post(
            f"{proxy.url()}/v1/encode", content=b"0" * (41 * 1024 * 1024), headers=AUTH, timeout=30
        )
        assert big.status_code == 413 and "ADDNORM_MAX_BODY_BYTES" in big.json()["error"], big.text
        odd = httpx.request("BREW", f"{proxy.url()}/v1/encode", headers=AUTH, timeout=10)
        assert odd.status_code == 405 and odd.json()["error"], odd.text
        # the server behind is still serving, through the proxy
        np.testing.assert_allclose(_readme_v1(proxy.url()), want_v1, atol=1e-5, rtol=1e-4)
    finally:
        if proxy is not None:
            proxy.remove()
        api.remove()


def test_the_ray_image_serves_the_model(images, repository, default_artifact):
    """The ray image's own command (Ray Serve, 2 replicas) on the same read-only artifact: ready through its
    proxy, the README's /v1 request answered as in-process onnxruntime answers it; stopped (its STOPSIGNAL,
    SIGINT), Serve shuts down and the container exits 0 within the grace period."""
    want_v1, _ = _in_process(default_artifact)
    env = {"ADDNORM_API_KEY_FILE": "/run/secrets/addnorm_api_key"}
    ports = {8000: free_port()}
    c = Container("localhost/addnorm-ray:latest", repository, env, ports, ("--shm-size", "512m"))
    try:
        print(f"ray: run -> ready in {c.wait_ready(timeout=300):.2f} s; image {images['ray'] / 1e6:.0f} MB")
        np.testing.assert_allclose(_readme_v1(c.url()), want_v1, atol=1e-5, rtol=1e-4)
        assert podman("healthcheck", "run", c.name, check=False).returncode == 0
        podman("stop", "-t", "30", c.name, timeout=90)
        assert json.loads(podman("inspect", c.name).stdout)[0]["State"]["ExitCode"] == 0, c.logs()
    finally:
        c.remove()


def test_the_compose_file_comes_up_under_docker_compose_driving_podman(images, default_artifact, tmp_path):
    """docker-compose.yml itself, unchanged, brought up by docker-compose's client against podman's Docker API
    (`podman system service`), with the ray profile: the export services write both artifacts into the volume
    with the export image, then the api serves both (127.0.0.1:8000, the compose file's ports), the front proxy
    in front of it (127.0.0.1:8080) and Ray Serve the default (127.0.0.1:8002), the README's request answered by each as in-process onnxruntime answers it on the
    same seeded default."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    want_v1, _ = _in_process(default_artifact)
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "api_key").write_text(KEY + "\n")
    sock = tmp_path / "podman.sock"
    service = subprocess.Popen([*PODMAN, "system", "service", "--time=0", f"unix://{sock}"])
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}"}
    compose = ["docker-compose", "-p", f"addnorm-images-{os.getpid()}", "--profile", "ray"]

    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*compose, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )

    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert time.monotonic() < deadline and service.poll() is None, (
                "podman system service did not start"
            )
            time.sleep(0.1)
        up = run("up", "-d", "--no-build", "api", "proxy", "ray")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        for port in (8000, 8080, 8002):
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, run("logs", timeout=60).stdout[-4000:]
                time.sleep(0.2)
            np.testing.assert_allclose(_readme_v1(f"http://127.0.0.1:{port}"), want_v1, atol=1e-5, rtol=1e-4)
        index = httpx.post("http://127.0.0.1:8000/v2/repository/index", headers=AUTH, timeout=10).json()
        assert {(m["name"], m["state"]) for m in index} == {("encoder", "READY"), ("encoder-int8", "READY")}
        exports = run("ps", timeout=60).stdout
        assert exports.count("Exit 0") == 2, exports  # export and export-int8 ran to completion
        # the int8 model runs on int8's kernels (the kernels stage's library, in /usr/local/lib/addnorm) where auto
        # picks them: on every CPU with AVX2 and FMA (model/kernels.NEEDS)
        logs = run("logs", "api", timeout=60)
        kernels_line = "kernels libaddnorm_kernels-" in logs.stdout + logs.stderr
        assert kernels_line == (not kernels.cpu_lacks()), (logs.stdout + logs.stderr)[-3000:]
    finally:
        run("down", "-v", timeout=300)
        service.terminate()
        service.wait(30)
