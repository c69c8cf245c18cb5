"""The Megatron-Core strategy imports Megatron-Core, which only the framework suite installs."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("megatron") else ["globalshard_torch/megatron.py"]
