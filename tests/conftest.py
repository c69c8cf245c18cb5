import os
import sys

# JAX tests see 8 CPU devices (set before anything imports jax).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: fixed examples (derandomized) so a red run is reproducible, and fast.
settings.register_profile("ci", max_examples=200, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=100, **_common)
# deep: `make deep-test`, by hand.
settings.register_profile("deep", max_examples=3000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Markers (pyproject.toml): `-m "not gloo and not e2e and not campaign"` is the quick loop.
_E2E = {"test_gpt_demo.py", "test_examples.py"}
_CAMPAIGN = {"test_crash.py", "test_corruption.py", "test_fuzz.py"}


def _names(code):
    """Global names a code object (and the functions defined in it) refers to."""
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= _names(const)
    return out


def _spawns_gloo(fn, module, spawners, helpers, seen=None) -> bool:
    """Whether ``fn`` calls a process-group runner, directly, as ``harness.run``, or through
    functions of its own module."""
    seen = set() if seen is None else seen
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _names(code)
    runners = {"run", "run_tolerating_deaths"}
    if names & {"torch_harness", "ranks", "gpt_trainer"} and (names | set(code.co_varnames)) & runners:
        return True  # imported inside the function
    for n in names:
        obj = getattr(module, n, None)
        if id(obj) in spawners or (id(obj) in helpers and names & runners):
            return True
        if callable(obj) and getattr(obj, "__module__", None) == module.__name__ \
                and _spawns_gloo(obj, module, spawners, helpers, seen):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    import pytest

    spawners, helpers = set(), set()
    for helper in ("torch_harness", "ranks", "gpt_trainer"):
        mod = sys.modules.get(helper)
        if mod is not None:
            helpers.add(id(mod))
            spawners |= {id(getattr(mod, n)) for n in ("run", "run_tolerating_deaths") if hasattr(mod, n)}
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name in _E2E:
            item.add_marker(pytest.mark.e2e)
        if name in _CAMPAIGN:
            item.add_marker(pytest.mark.campaign)
        module = getattr(item, "module", None)
        if module is None or not spawners:
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        if any(_spawns_gloo(fn, module, spawners, helpers) for fn in [getattr(item, "function", None), *fixtures]):
            item.add_marker(pytest.mark.gloo)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with a bucket ``ckpt``: (kvstore spec, boto3 client, server log path)."""
    import socket
    import subprocess
    import time

    import boto3

    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update({k: env[k] for k in saved})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
        client.create_bucket(Bucket="ckpt")
        spec = {"driver": "s3", "bucket": "ckpt", "endpoint": f"http://127.0.0.1:{port}",
                "aws_region": "us-east-1", "aws_credentials": {"type": "environment"}}
        yield spec, client, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
