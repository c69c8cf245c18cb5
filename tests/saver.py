"""Saves and loads run in other processes, for tests of what real processes do
to one checkpoint: racing saves, kills at chosen points, loads during an
overwrite. Every state a writer saves is stamped with the writer's ``tag``,
so a loaded checkpoint shows whose data it holds, tensor by tensor.

Run as a script, it saves one stamped state and, with ``--kill-at N``, kills
itself with SIGKILL at its N-th filesystem operation (Python audit events:
open, rename, remove, rmdir, mkdir, ...) or, with ``--kill-after S``, S
seconds into the save. ``--count`` prints how many operations a whole save
makes, so a caller can spread kill points over every phase of it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

import globalshard as gs

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = 6
ROWS, COLS = 64, 1024  # 256 KiB per key in float32: one chunk each
BIG = (1536, 1024)  # 6 MiB: a sharded array of six 1 MiB inner chunks

# The filesystem operations a kill point may land on (CPython audit events).
_EVENTS = frozenset({"open", "os.rename", "os.replace", "os.remove", "os.unlink", "os.rmdir", "os.mkdir",
                     "shutil.rmtree", "os.listdir", "os.scandir", "os.symlink", "os.truncate", "os.chmod"})


def stamped_state(tag: int, *, tp: int = 2, rank: int | None = None) -> dict[str, gs.ShardedTensor]:
    """Every key's global array is filled from ``tag``; ``tp`` ranks' shards
    (all of them, or only ``rank``'s)."""
    out = {}
    for k in range(KEYS):
        full = expected(tag, k)
        n = ROWS // tp
        for r in range(tp) if rank is None else [rank]:
            out[f"k{k}.tp{r}"] = gs.ShardedTensor.from_offset(
                f"layer{k}.w", full[r * n:(r + 1) * n].copy(), global_shape=full.shape, global_offset=(r * n, 0))
    big = expected(tag, "big")
    n = BIG[0] // tp
    for r in range(tp) if rank is None else [rank]:
        out[f"big.tp{r}"] = gs.ShardedTensor.from_offset(
            "big", big[r * n:(r + 1) * n].copy(), global_shape=BIG, global_offset=(r * n, 0))
    return out


def expected(tag: int, k: int | str) -> np.ndarray:
    if k == "big":
        return np.random.default_rng(tag * 1000 + 999).standard_normal(BIG).astype(np.float32)
    return (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1e6 * tag + 1e4 * int(k))


def whose(path: Any, **kw: Any) -> int:
    """Load the checkpoint whole and return the one tag all of it carries.

    Raises:
        AssertionError: the checkpoint mixes writers (or holds wrong values).
        GlobalShardError: it does not load.
    """
    targets = {f"k{k}": gs.ShardedTensor.from_offset(f"layer{k}.w", np.zeros((ROWS, COLS), np.float32),
                                                     global_shape=(ROWS, COLS), global_offset=(0, 0))
               for k in range(KEYS)}
    targets["big"] = gs.ShardedTensor.from_offset("big", np.zeros(BIG, np.float32), global_shape=BIG,
                                                  global_offset=(0, 0))
    trainer = gs.load(targets, path, **kw)
    tag = trainer["tag"]
    for k in range(KEYS):
        assert np.array_equal(targets[f"k{k}"].data, expected(tag, k)), f"layer{k}.w is not writer {tag}'s"
    assert np.array_equal(targets["big"].data, expected(tag, "big")), f"big is not writer {tag}'s"
    return int(tag)


def save_stamped(path: Any, tag: int, *, overwrite: bool = False, **kw: Any) -> None:
    gs.save(stamped_state(tag), path, trainer_state={"tag": tag}, overwrite=overwrite, **kw)


def race(args: tuple[str, int, bool, float, Any]) -> str:
    """One racer: wait until ``start`` (a time.time()), save, report the outcome."""
    path, tag, overwrite, start, kvstore = args
    time.sleep(max(0.0, start - time.time()))
    try:
        save_stamped(path, tag, overwrite=overwrite, kvstore=kvstore)
        return "ok"
    except gs.GlobalShardError as e:
        return f"{type(e).__name__}: {e}"


def _kill_at(n: int) -> None:
    count = [0]

    def hook(event: str, _args: Any) -> None:
        if event in _EVENTS:
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def _counter() -> list[int]:
    count = [0]

    def hook(event: str, _args: Any) -> None:
        if event in _EVENTS:
            count[0] += 1

    sys.addaudithook(hook)
    return count


def writer_hook(kill_at: int | None, count_file: str | None) -> None:
    """Run in the writer process (``Writer(setup=...)``): SIGKILL it at its
    ``kill_at``-th filesystem operation, or count them into ``count_file`` at its exit."""
    import atexit

    if kill_at:
        _kill_at(kill_at)
    if count_file:
        count = _counter()
        atexit.register(lambda: open(count_file, "w").write(str(count[0])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--tag", type=int, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--kvstore", help="a kvstore spec as JSON")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-after", type=float)
    parser.add_argument("--count", action="store_true")
    parser.add_argument("--manager", action="store_true", help="save through globalshard_torch's manager")
    parser.add_argument("--async-save", action="store_true", help="through gs.AsyncSaver")
    parser.add_argument("--pack-below", type=int, default=0, help="save(pack_below=)")
    parser.add_argument("--mode", default="process", help="the AsyncSaver's mode")
    parser.add_argument("--writer-kill-at", type=int, help="SIGKILL the writer process at its n-th operation")
    parser.add_argument("--writer-count", help="count the writer process's operations into this file")
    parser.add_argument("--ignore-sigxfsz", action="store_true",
                        help="under a file-size limit, fail writes with EFBIG instead of dying")
    args = parser.parse_args()
    if args.ignore_sigxfsz:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    kvstore = json.loads(args.kvstore) if args.kvstore else None
    state = stamped_state(args.tag)  # built before any kill point: the save is what is measured
    if args.manager:
        import globalshard_torch.checkpoint  # noqa: F401  (imported before the kill points are counted)
    count = _counter() if args.count else None
    if args.kill_at:
        _kill_at(args.kill_at)
    if args.kill_after is not None:
        threading.Timer(args.kill_after, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.perf_counter()
    if args.manager:
        _manager_save(args.path, args.tag, state)
    elif args.async_save:
        writer = None
        if args.writer_kill_at or args.writer_count:
            from globalshard.checkpoint.writer import Writer

            # The writer imports the hook by name from this script's module.
            os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])])
            writer = Writer(setup=("saver:writer_hook", [args.writer_kill_at, args.writer_count]))
        background = gs.AsyncSaver(args.mode, writer=writer)
        background.save(state, args.path, trainer_state={"tag": args.tag}, overwrite=args.overwrite,
                        kvstore=kvstore)
        for t in state.values():
            t.data[...] = 0  # the snapshot, not the live arrays, is what gets written
        try:
            background.wait()
        except gs.GlobalShardError as e:  # the writer was killed: the save failed, the process did not
            print(json.dumps({"failed": f"{type(e).__name__}: {e}"}))
            os._exit(3)
        if writer is not None:
            writer.close()  # its count is written at its exit
    else:
        gs.save(state, args.path, trainer_state={"tag": args.tag}, overwrite=args.overwrite, kvstore=kvstore,
                pack_below=args.pack_below)
    if count is not None:
        print(json.dumps({"events": count[0], "seconds": time.perf_counter() - start}))
    os._exit(0)  # a kill timer must not outlive the save


def _manager_save(root: str, tag: int, state: dict[str, gs.ShardedTensor]) -> None:
    from globalshard_torch.checkpoint import CheckpointManager

    manager = CheckpointManager(root, keep_last=2)
    manager.save_with(tag, lambda path: gs.save(state, path, trainer_state={"tag": tag}))


if __name__ == "__main__":
    main()
