"""Hostile metadata: the structure-aware fuzzer of tests/fuzz_metadata.py on a
CI-sized, fixed-seed set of inputs (the documented command runs 100,000)."""

import os

from fuzz_metadata import run


def test_parsers_answer_every_hostile_input_with_their_own_error():
    result = run(int(os.environ.get("GLOBALSHARD_FUZZ_INPUTS", "4000")), seed=7)
    assert result["failures"] == [], result["failures"][:5]
    assert result["metadata refused"] > 0 and result["trainer state accepted"] > 0  # both paths exercised
