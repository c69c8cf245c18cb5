import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: fixed examples (derandomized) so a red run is reproducible, and fast.
settings.register_profile("ci", max_examples=200, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=100, **_common)
# deep: `make deep-test`, by hand.
settings.register_profile("deep", max_examples=3000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
