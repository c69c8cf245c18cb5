"""What a root without metadata.json holds, from the names below it."""

from hypothesis import given
from hypothesis import strategies as st

from globalshard.format.paths import foreign_files, step_names


def test_other_libraries_checkpoints_are_named_by_their_own_files():
    assert "DCP" in foreign_files([".metadata", "__0_0.distcp", "__1_0.distcp"])
    assert "Orbax" in foreign_files(["_CHECKPOINT_METADATA", "default"])  # a step of Orbax's CheckpointManager
    assert "Orbax" in foreign_files(["_METADATA", "manifest.ocdbt", "d"])  # an item's directory
    assert "load_hf" in foreign_files(["config.json", "model-00001-of-00002.safetensors"])
    assert "Megatron" in foreign_files(["mp_rank_00", "mp_rank_01"])
    assert foreign_files(["saves", ".globalshard.lock"]) is None  # a save of ours that did not commit
    assert foreign_files([]) is None


@given(st.lists(st.text(alphabet="ab-_.0123456789", max_size=8), unique=True), st.integers(1, 10))
def test_step_names_are_the_numbered_ones_highest_first(names, limit):
    got = step_names(names, limit)
    numbered = [n for n in names if any(c.isdigit() for c in n) and not n.startswith(".")]
    assert len(got) == min(limit, len(numbered)) and set(got) <= set(numbered)
    last = [int("".join(c if c.isdigit() else " " for c in n).split()[-1]) for n in got]
    assert last == sorted(last, reverse=True)
    omitted = set(numbered) - set(got)  # none left out has a higher number than one kept
    assert all(int("".join(c if c.isdigit() else " " for c in n).split()[-1]) <= min(last) for n in omitted)
