"""Where the repository's parts are, for a test in any folder of tests/."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SPEC = os.path.join(ROOT, "spec")
EXAMPLES = os.path.join(ROOT, "examples")
