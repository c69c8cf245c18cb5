"""The README's example must run as printed."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_example_runs(tmp_path):
    with open(README) as f:
        code = re.search(r"## Example\n\n```python\n(.*?)```", f.read(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ckpt" / "metadata.json").exists()
    assert "[[ 3.  4.]" in out.stdout
