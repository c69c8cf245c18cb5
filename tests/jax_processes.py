"""JAX processes joined by ``jax.distributed`` on 127.0.0.1, for the tests of
what several JAX processes do (the adapter's and Orbax's)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def two_processes(tmp_path: Path, worker: str, *args: Any) -> list[str]:
    """Run ``worker`` in 2 processes joined by jax.distributed on 127.0.0.1; the line
    each printed that starts with ``ok`` (jax's gloo prints lines of its own)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i), *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    oks = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        oks.append(next((line for line in out.splitlines() if line.startswith("ok")), None))
        assert oks[-1] is not None, out
    return oks
