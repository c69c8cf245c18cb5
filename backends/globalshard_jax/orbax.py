"""Orbax's ``CheckpointManager`` storing an item as a globalshard checkpoint.

Orbax saves each item of a step with the handler its arguments are
registered with. :class:`Save` and :class:`Restore` are registered with
:class:`Handler`, which writes the item's directory with
:func:`globalshard_jax.save` and reads it with :func:`globalshard_jax.load`;
the manager's steps, retention and atomic step directories stay Orbax's::

    import orbax.checkpoint as ocp
    import globalshard_jax.orbax as gjo

    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    manager.save(step, args=ocp.args.Composite(state=gjo.Save(state), meta=ocp.args.JsonSave({"step": step})))
    restored = manager.restore(step, args=ocp.args.Composite(state=gjo.Restore(abstract_state)))

:class:`Handler` is synchronous: Orbax runs it before its ``save`` returns,
even when the manager checkpoints asynchronously (its other items still
write in the background). For a background save of a pytree, call
:func:`globalshard_jax.save` with ``saver=`` yourself.

Importing this module needs orbax-checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp

from globalshard_jax.loading import load
from globalshard_jax.saving import save

__all__ = ["Handler", "Restore", "Save"]


class Handler(ocp.CheckpointHandler):
    """Writes and reads an Orbax item's directory as a globalshard checkpoint."""

    def save(self, directory: Any, args: Save) -> None:
        # TODO(limitation): synchronous under Orbax's manager; gj.save(saver=) saves in the background.
        save(str(directory), args.item, trainer_state=args.trainer_state, overwrite=True)

    def restore(self, directory: Any, args: Restore | None = None) -> Any:
        args = args if args is not None else Restore()
        tree, _ = load(str(directory), args.item, strict=args.strict, allow_lossy_cast=args.allow_lossy_cast)
        return tree


@ocp.args.register_with_handler(Handler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
    """Save ``item`` (a pytree of arrays, as :func:`globalshard_jax.save` takes it),
    with ``trainer_state`` (JSON) beside it."""

    item: Any
    trainer_state: dict[str, Any] | None = None


@ocp.args.register_with_handler(Handler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
    """Restore onto ``item`` (abstract or concrete arrays with their shardings, as
    :func:`globalshard_jax.load` takes it), or, without it, the saved pytree whole."""

    item: Any = None
    strict: bool = True
    allow_lossy_cast: bool = False
