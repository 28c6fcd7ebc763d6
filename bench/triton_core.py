"""addnorm-triton's repository on a real Triton core: the tritonserver that nvidia-pytriton bundles.

    python -m bench.triton_core [ARTIFACT]      # needs nvidia-pytriton and onnxruntime in some environment

nvidia-pytriton ships Triton's core with the python backend only (no onnxruntime backend), so the repository
is written by ``addnorm-triton`` and copied with exactly three lines of its config.pbtxt changed (``backend:
"python"``; no ``platform``, no ``default_model_filename``), and a ``model.py`` that runs the repository's own
model.onnx on onnxruntime, feeding exactly the inputs Triton passes it (an absent mask is not fed: the graph's
default answers for it, as onnxruntime's backend would do). Everything else Triton's core decides itself: the
config's inputs, outputs, optional mask, batching and instance group. Then the README's request (embeddings
only) and a padded one go to it over HTTP, and their answers are compared with the export's graph.

``ADDNORM_PYTRITON_SITE``: the site-packages of an environment with nvidia-pytriton, numpy and onnxruntime
(default: the running Python's). Prints one line per check; exits 1 when one fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK

MODEL_PY = """import os
import sys

sys.path.append({site!r})  # numpy and onnxruntime for the backend's stub

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        self.session = ort.InferenceSession(os.path.join(here, "model.onnx"), providers=["CPUExecutionProvider"])

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {{{emb!r}: pb_utils.get_input_tensor_by_name(request, {emb!r}).as_numpy()}}
            mask = pb_utils.get_input_tensor_by_name(request, {mask!r})
            if mask is not None:
                feeds[{mask!r}] = mask.as_numpy()
            (out,) = self.session.run([{out!r}], feeds)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor({out!r}, out)]))
        return responses
"""


def python_backend_copy(repo: Path, out: Path, site: str) -> None:
    for model in (d for d in repo.iterdir() if d.is_dir()):
        shutil.copytree(model, out / model.name)
        config = out / model.name / "config.pbtxt"
        lines = config.read_text().splitlines()
        kept = [
            'backend: "python"' if line.startswith("backend:") else line
            for line in lines
            if not line.startswith(("platform:", "default_model_filename:"))
        ]
        config.write_text("\n".join(kept) + "\n")
        for version in (d for d in (out / model.name).iterdir() if d.name.isdigit()):
            source = MODEL_PY.format(site=site, emb=EMBEDDINGS, mask=MASK, out=ENCODED)
            (version / "model.py").write_text(source)


def main(argv: list[str] | None = None) -> int:
    import httpx
    import onnxruntime as ort
    import tritonclient.http as httpclient

    from addnorm.model.artifact import Manifest
    from addnorm.service.protocols.v2.triton_repo import write_repository
    from bench.server import free_port

    args = argv if argv is not None else sys.argv[1:]
    artifact = Path(args[0]) if args else DEFAULT_ARTIFACT
    manifest = Manifest.load(artifact)
    site = os.environ.get("ADDNORM_PYTRITON_SITE") or next(p for p in sys.path if p.endswith("site-packages"))
    core = Path(site) / "pytriton" / "tritonserver"
    if not (core / "bin" / "tritonserver").exists():
        print(f"no Triton core in {site} (pip install nvidia-pytriton there, or set ADDNORM_PYTRITON_SITE)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_repository(artifact, tmp / "repo")
        python_backend_copy(tmp / "repo", tmp / "python_repo", site)
        backends = tmp / "backends" / "python"
        shutil.copytree(core / "backends" / "python", backends, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(core / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" /
                    "triton_python_backend_stub", backends)  # fmt: skip
        port = free_port()
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(site) / "nvidia_pytriton.libs")}
        cmd = [str(core / "bin" / "tritonserver"), "--model-repository", str(tmp / "python_repo"),
               "--backend-directory", str(tmp / "backends"), "--http-port", str(port), "--grpc-port",
               str(free_port()), "--allow-metrics", "false", "--exit-timeout-secs", "5"]  # fmt: skip
        log = (tmp / "triton.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                if proc.poll() is not None:
                    print((tmp / "triton.log").read_text()[-3000:])
                    return 1
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            version = httpx.get(f"http://127.0.0.1:{port}/v2").json()["version"]
            client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            reference = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
            name, e = manifest.name, manifest.config.d_model
            x = np.ones((1, 4, e), np.float32)
            inp = httpclient.InferInput(EMBEDDINGS, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer(name, [inp]).as_numpy(ENCODED)
            want = reference.run(None, {EMBEDDINGS: x, MASK: np.zeros((1, 4), bool)})[0]
            unmasked = float(np.abs(got - want).max())
            print(f"Triton {version}: the README's request (no mask) -> {got[0, 0, :3]}, export's graph "
                  f"{want[0, 0, :3]}, max abs diff {unmasked:.1e}")  # fmt: skip
            x = np.random.default_rng(0).standard_normal((1, 6, e)).astype(np.float32)
            mask = np.array([[False] * 4 + [True] * 2])
            inputs = [httpclient.InferInput(EMBEDDINGS, list(x.shape), "FP32"),
                      httpclient.InferInput(MASK, list(mask.shape), "BOOL")]  # fmt: skip
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(mask)
            got = client.infer(name, inputs).as_numpy(ENCODED)[:, :4]
            want = reference.run(None, {EMBEDDINGS: x, MASK: mask})[0][:, :4]
            diff = float(np.abs(got - want).max())
            print(f"Triton {version}: a padded request -> max abs diff on its real positions {diff:.1e}")
            return 0 if max(unmasked, diff) < 1e-5 else 1
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
