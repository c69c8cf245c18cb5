"""A fast tier that reshards: each step saved to the nodes' own storage and
copied to the next nodes of the ring, drained in the background to the
persistent tier, and recovered onto any layout from the nearest copy of each
stored read (spec/FORMAT.md section 5.3)."""

from globalshard.tiers.local import LocalTier
from globalshard.tiers.manager import TieredManager
from globalshard.tiers.recovery import Recovery, TieredCheckpoint

__all__ = ["LocalTier", "Recovery", "TieredCheckpoint", "TieredManager"]
