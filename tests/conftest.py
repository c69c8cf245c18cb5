import os
import sys

# JAX tests see 8 CPU devices (set before anything imports jax).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: fixed examples (derandomized) so a red run is reproducible, and fast.
settings.register_profile("ci", max_examples=200, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=100, **_common)
# deep: `make deep-test`, by hand.
settings.register_profile("deep", max_examples=3000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
