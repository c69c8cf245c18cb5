import subprocess
import sys


def test_core_imports_no_framework():
    code = "import sys, globalshard; print(sorted(m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_core_imports_tensorstore_only_when_it_is_used():
    """A process that only touches local files never loads TensorStore
    (store/base.py imports it on first use)."""
    code = ("import sys, numpy as np, globalshard as gs, tempfile, os\n"
            "d = tempfile.mkdtemp()\n"
            "t = gs.ShardedTensor.from_offset('w', np.ones((4, 3), np.float32), global_shape=(4, 3), "
            "global_offset=(0, 0))\n"
            "gs.save({'w': t}, os.path.join(d, 'c'))\n"
            "gs.load({'w': t}, os.path.join(d, 'c'))\n"
            "print('tensorstore' in sys.modules)\n"
            "import shutil; shutil.rmtree(d)\n"
            "gs.save({'w': t}, 'memory://x/c')\n"
            "print('tensorstore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_public_api_names():
    import globalshard as gs

    for name in ["Box", "Segment", "Region", "ShardedTensor", "ShardedStateDict", "save", "load", "read_metadata",
                 "read_array", "GlobalShardError", "MetadataError", "LayoutError", "SavePlanner", "LoadPlanner"]:
        assert name in gs.__all__ and hasattr(gs, name)
    assert issubclass(gs.MetadataError, gs.GlobalShardError) and issubclass(gs.MetadataError, ValueError)
    for name in gs.__all__:
        obj = getattr(gs, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, Exception) and (obj is gs.GlobalShardError or issubclass(obj, gs.GlobalShardError))
