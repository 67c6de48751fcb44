"""The layering rules are checked, not just written down."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_pickle_or_torch_load_on_peer_data() -> None:
    offenders = []
    for path in [*ROOT.glob("protocol/*.py"), *ROOT.glob("swarm/*.py"), *ROOT.glob("node/*.py")]:
        text = path.read_text()
        if "import pickle" in text or "torch.load(" in text:
            offenders.append(path.name)
    assert offenders == []
