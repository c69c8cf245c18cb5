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

:class:`Handler` saves as Orbax's own handlers do: with an asynchronous
manager, ``save`` returns once this process's shards are copied to host
memory (the arrays may then be donated), and the writing and the commit go
on in the background, after the manager has made the item's directory;
``wait_until_finished`` waits for them and raises their error.

Importing this module needs orbax-checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import future

import globalshard as gs
from globalshard_jax.comm import default_comm
from globalshard_jax.loading import load, metadata
from globalshard_jax.saving import prepared

__all__ = ["Handler", "Restore", "Save"]


class Handler(ocp.AsyncCheckpointHandler):
    """Writes and reads an Orbax item's directory as a globalshard checkpoint."""

    async def async_save(self, directory: Any, args: Save) -> list[Any]:
        """Copy this process's shards to host memory now; write them, and commit,
        in the future Orbax waits for (after it has made ``directory``)."""
        # Orbax writes a step's items at the same time, in threads of each process: each item's exchanges
        # in a namespace of its own (its directory, the same on every process), so that they never meet.
        comm = default_comm(namespace=str(directory))
        # Host arrays: copied from an accelerator, or on the CPU views that keep their buffers from being
        # donated (jax copies instead), so the arrays may be donated once this returns.
        state, described = prepared(args.item, args.trainer_state, None, comm)

        async def write() -> None:
            gs.save(state, str(directory), trainer_state=described, comm=comm, overwrite=True)

        return [future.CommitFutureAwaitingContractedSignals(write(), name="globalshard_save")]

    def save(self, directory: Any, args: Save) -> None:
        async def wait() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        # In a thread of its own: the caller may be inside a running event loop (a notebook).
        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _run(wait(), errors), name="globalshard-orbax-save")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    def metadata(self, directory: Any) -> Any:
        """The item's pytree with a ``jax.ShapeDtypeStruct`` per leaf
        (:func:`globalshard_jax.metadata`), what Orbax's ``item_metadata`` gives."""
        return metadata(str(directory))

    def restore(self, directory: Any, args: Restore | None = None) -> Any:
        args = args if args is not None else Restore()
        tree, _ = load(str(directory), args.item, strict=args.strict, allow_lossy_cast=args.allow_lossy_cast)
        return tree


def _run(coroutine: Any, errors: list[BaseException]) -> None:
    try:
        asyncio.run(coroutine)
    except BaseException as e:  # raised by save() in the caller's thread
        errors.append(e)


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
