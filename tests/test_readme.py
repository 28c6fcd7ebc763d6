"""Every code block of README.md and of the guides in docs/ (GUIDES) runs as written, in order (issues 27, 66): a
new user's first hour, in a fresh directory with only the default artifact in it (what ``make serve`` leaves), with
``.venv/bin`` first on PATH; each page starts with the default artifact served, as its first line says. An output
block right after a README block is what that block prints, exactly: the README prints rounded figures, so that
they hold on every CPU kind. A guide's output block shows raw float32s: it is what its block prints but for the
last digits of its numbers (``alike``: float32's spread between CPU kinds), and where the block cuts its output
(``head -c``) up to the last number both show whole.

``sh`` blocks run line by line in bash; a line that starts ``addnorm-serve`` starts that server in the background
(as a user's other terminal would) and waits until it is ready: beside ``make serve``'s on 8000/8001 when it names
ports of its own (the README's text quickstart, 8100/8101), in place of it otherwise. ``python`` blocks run each in
its own interpreter. Every port a page names (8000, 8001, 8100, ...) is one of the test's free ports. A block
the test cannot run has ``<!-- readme-test: skip: why -->`` on the line above it, and the reason must name where
else it is tested. An answer holding ``"error"`` fails, unless the README's own output block after it shows one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.server import free_ports
from tests.conftest import ROOT
from tests.helpers import wait_until

# The pages whose blocks run, in this order, after README.md (the README's old sections, in their old order).
GUIDES = (
    "docs/text.md",
    "docs/serving.md",
    "docs/export.md",
    "docs/configuration.md",
    "docs/deployment.md",
    "docs/tasks.md",  # last: its model joins the artifacts/ the serving guide lists
)
SKIP = re.compile(r"<!-- readme-test: skip: (.+?) -->")
SERVE = re.compile(r"^(\w+=\S+ )*addnorm-serve\b")
NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # where it starts in README.md
    skip: str | None  # why the test does not run it
    shows_error: bool  # the README's output block right after it shows an error answer
    output: str | None = None  # the output block right after it, if any


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    found: list[Block] = []
    i = after = 0  # after: the line after the last block's closing fence
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        skip = SKIP.search(lines[start - 1]) if start else None
        found.append(Block(lang, "\n".join(lines[start + 1 : end]), start + 1, skip and skip[1], False))
        # an output block is one right after its block (blank lines between at most), never one past some prose
        if lang == "" and len(found) > 1 and not any(line.strip() for line in lines[after:start]):
            found[-2].output = found[-1].code
            found[-2].shows_error = '"error"' in found[-1].code
        i = after = end + 1
    return found


def commands(code: str) -> list[str]:
    """A sh block's commands: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [c for c in (line.strip() for line in joined.splitlines()) if c and not c.startswith("#")]


PORT = re.compile(r"(?<=:)(8[0-9]{3})\b|(?<=--port )(8[0-9]{3})\b|(?<=--grpc-port )(8[0-9]{3})\b")


class Session:
    """The user's terminals: a working directory, an environment, a server per HTTP port the pages name (make
    serve's on 8000), each of the pages' ports one of the test's free ports."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.ports: dict[str, int] = {}
        self.http, self.grpc = self.port("8000"), self.port("8001")
        venv = Path(sys.executable).parent
        self.env = {
            **os.environ,
            "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}",
            "ADDNORM_PORT": str(self.http),  # the README's commands give no port: the variables place them
            "ADDNORM_GRPC_PORT": str(self.grpc),
            "PYTHONPATH": "",
        }
        self.servers: dict[int, subprocess.Popen] = {}  # by HTTP port
        self.log = work / "server.log"

    def port(self, shown: str) -> int:
        """The free port standing for the port ``shown`` on a page."""
        if shown not in self.ports:
            self.ports[shown] = free_ports(1)[0]
        return self.ports[shown]

    def localize(self, text: str) -> str:
        """Every port the text names (an address's, or a --port/--grpc-port flag's) as its free port."""
        return PORT.sub(lambda m: str(self.port(m.group(0))), text)

    def serve(self, command: str) -> None:
        """``command`` in the background, on the HTTP port it names (else make serve's), replacing only a server on
        that port; ready when its /health/ready answers 200."""
        command = re.sub(r"\s+# .*$", "", command)  # a comment after it
        command = command.removesuffix("&").strip()  # the page runs it in the background: so does the test
        named = re.search(r"--port (\d+)", command)
        port = int(named[1]) if named else self.http
        self.stop(port)
        log_path = self.work / f"server-{port}.log"
        with log_path.open("w") as log:
            server = subprocess.Popen(
                ["bash", "-c", f"exec env {command}"], cwd=self.work, env=self.env, stdout=log, stderr=log
            )
        self.servers[port] = server

        def ready() -> bool:
            assert server.poll() is None, f"`{command}` exited: {log_path.read_text()[-3000:]}"
            # urllib, not httpx: a refused connection costs it ~0.2 ms of CPU, httpx.get ~30 ms (a client and its
            # TLS context made each time), which polled every 20 ms took 15 s of the test's CPU
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=5) as r:
                    return r.status == 200
            except OSError:  # refused, reset, or an HTTPError (not ready yet)
                return False

        wait_until(ready, 180, f"`{command}` ready")

    def run(self, argv: list[str], what: str, shows_error: bool) -> str:
        r = subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"{what} exited {r.returncode}:\n{out[-3000:]}"
        assert shows_error or '"error"' not in r.stdout, f"{what} answered an error:\n{out[-3000:]}"
        return out

    def stop(self, port: int | None = None) -> None:
        """The server on ``port``, or every one."""
        for p in [port] if port is not None else list(self.servers):
            server = self.servers.pop(p, None)
            if server is not None and server.poll() is None:
                server.terminate()
                server.wait(30)


def _bert_checkpoint(path: Path) -> None:
    """A randomly initialised Hugging Face BertModel's model directory (config.json + model.safetensors; nothing is
    downloaded): 2 layers, 96 wide, 12 heads, no tokenizer."""
    import torch
    import transformers

    config = transformers.BertConfig(
        hidden_size=96, num_attention_heads=12, intermediate_size=192, num_hidden_layers=2
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(str(path))


def test_every_readme_block_runs_as_written_in_order(default_artifact, tmp_path):
    pages = {page: readme_blocks((ROOT / page).read_text()) for page in ("README.md", *GUIDES)}
    runnable = {
        page: [b for b in blocks if b.lang in ("sh", "python") and not b.skip]
        for page, blocks in pages.items()
    }
    assert len(runnable["README.md"]) >= 3 and sum(map(len, runnable.values())) >= 15, (
        runnable
    )  # the parser found them
    for (
        page,
        blocks,
    ) in pages.items():  # a skipped block names the test file that runs it (one that exists), or a GPU
        for b in blocks:
            if b.skip:
                named = re.findall(r"tests/[\w/]+\.py", b.skip)
                assert named or "GPU" in b.skip, f"{page} line {b.line}: say which tests/*.py runs it"
                missing = [n for n in named if not (ROOT / n).is_file()]
                assert not missing, f"{page} line {b.line}: no such test file {missing}"
    work = tmp_path / "clone"
    shutil.copytree(default_artifact, work / "artifacts" / "default")  # what make serve leaves
    _bert_checkpoint(work / "bert-model")  # the export guide's "a BERT model directory you fetched"
    session = Session(work)
    try:
        for page, blocks in runnable.items():
            session.stop()
            session.serve(
                "addnorm-serve --artifact artifacts/default"
            )  # make serve's last step, in its terminal
            for b in blocks:
                _run_block(session, b, f"{page} line {b.line}", exact=page == "README.md")
            if page == "README.md":  # what the README starts runs beside make serve's, never in its place
                assert session.http in session.servers and len(session.servers) >= 2, session.servers
    finally:
        session.stop()
    left = sorted(p.name for p in work.iterdir())
    made = ("req.json", "v2.json", "layer.safetensors", "model-dir.txt")
    assert set(made) <= set(left), left  # and .gitignore has them
    ignored = (ROOT / ".gitignore").read_text().split()
    assert all(f"/{name}" in ignored for name in (*made, "triton-repo/"))


def _run_block(session: Session, b: Block, where: str, exact: bool) -> None:
    """One block in the user's terminal; with ``exact``, what it prints must be its output block, as shown."""
    code = session.localize(b.code)
    if b.lang == "python":
        printed = session.run([sys.executable, "-c", code], f"{where} (python)", b.shows_error)
    else:
        printed = ""
        for command in commands(code):
            if SERVE.match(command):
                session.serve(command)
            else:
                printed = session.run(["bash", "-c", command], f"{where}: `{command}`", b.shows_error)
    if b.output is None:
        return
    if exact:  # a sh block's output block shows its last command's
        assert printed.strip() == b.output.strip(), (
            f"{where} printed {printed.strip()!r}, shows {b.output.strip()!r}"
        )
    else:
        assert alike(printed, b.output, cut="head -c" in code), (
            f"{where} printed {printed!r}, shows {b.output!r}"
        )


def alike(printed: str, shown: str, cut: bool = False, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """``printed`` is ``shown`` but for its numbers' last digits: the text between numbers the same (runs of
    spaces as one, none inside brackets: numpy aligns its columns by their digits), each number within
    ``atol + rtol * |shown|``. ``cut``: both were cut after so many characters, so only the numbers both show whole
    are compared (at least all but two of the longer's)."""
    texts, numbers = [], []
    for s in (printed, shown):
        s = re.sub(r"([\[(]) | ([\])])", r"\1\2", re.sub(r"\s+", " ", s.strip()))
        found = list(NUMBER.finditer(s))
        if cut and found:  # the last one may be cut short
            s, found = s[: found[-1].start()], found[:-1]
        texts.append(NUMBER.split(s))
        numbers.append([float(m[0]) for m in found])
    n = min(map(len, numbers))
    if cut:
        if n < max(map(len, numbers)) - 2:
            return False
        texts = [t[:n] for t in texts]  # the text before each number compared (what follows the last is cut)
    elif len(numbers[0]) != len(numbers[1]):
        return False
    return texts[0] == texts[1] and all(
        abs(a - b) <= atol + rtol * abs(b) for a, b in zip(numbers[0][:n], numbers[1][:n], strict=True)
    )


@pytest.mark.unit
def test_a_guides_output_may_differ_in_its_numbers_last_digits_only():
    shown = "(8, 128, 768) [ 0.40606278 -0.20658901  0.6748876 ]"
    assert alike("(8, 128, 768) [ 0.40606275 -0.20658901  0.6748876 ]", shown)
    assert alike("(8, 128, 768) [0.406063   -0.206589  0.674888]", shown)  # numpy's columns, shorter digits
    assert not alike("(8, 128, 768) [ 0.41606278 -0.20658901  0.6748876 ]", shown)  # another answer
    assert not alike("(8, 128, 767) [ 0.40606278 -0.20658901  0.6748876 ]", shown)
    assert not alike("(8, 128, 768) [ 0.40606278 -0.20658901 ]", shown)
    assert not alike('{"encoded":[[0.0296]]}', '{"encoding":[[0.0296]]}')
    whole = '{"encoded":[[0.029600404,-0.5877869,-1.8657454,0.56703913,0.16583282],"shape":[1,5]}'
    longer = '{"encoded":[[0.029600233,-0.58778715,-1.8657457,0.56703943,0.16583331],"shape":[1,5]}'
    for n in (60, 64, 75):  # both cut after n characters: a number cut short is not compared ...
        assert alike(longer[:n], whole[:n], cut=True)
    assert not alike(longer[:64], whole[:64])  # ... which, taken whole, differs: "0.1658" against "0.16583"
    assert not alike(longer.replace("-1.8657457", "-1.9657457")[:60], whole[:60], cut=True)


@pytest.mark.unit
def test_the_parser_reads_blocks_skips_and_error_outputs():
    text = "\n".join(
        [
            "```sh",
            "curl -s x \\",
            "   -d y   # a comment",
            "# only a comment",
            "```",
            "```",
            '{"error":"bad"}',
            "```",
            "<!-- readme-test: skip: needs a GPU -->",
            "```python",
            "print(1)",
            "```",
            "Some prose, then a block of another page's output:",
            "```",
            "2",
            "```",
        ]
    )
    sh, out, py, other = readme_blocks(text)
    assert sh.lang == "sh" and sh.shows_error and commands(sh.code) == ["curl -s x  -d y   # a comment"]
    assert (
        sh.output == '{"error":"bad"}' and out.lang == "" and py.skip == "needs a GPU" and not py.shows_error
    )
    assert py.output is None and other.code == "2"
