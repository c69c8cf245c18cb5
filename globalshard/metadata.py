"""Moved to :mod:`globalshard.format.metadata`; this name keeps working."""

from globalshard.format.metadata import *  # noqa: F403
from globalshard.format.metadata import __all__  # noqa: F401
