import subprocess
import sys
from pathlib import Path

from repo import ROOT as REPO_ROOT

ROOT = Path(REPO_ROOT)


def test_numpy_demo(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "numpy_demo.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Every loaded element equals the original" in out.stdout
    assert "TP=4 -> TP=1" in out.stdout


def test_torch_resume_example(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_resume.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "max |loss difference|" in out.stdout
