import subprocess
import sys

from tests.conftest import ROOT


def test_importing_the_service_does_not_import_torch_or_export():
    code = "import sys, service, service.cli, service.front.app; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'export')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
