"""numpy views of torch tensors, so the core reads and writes torch memory directly.

CPU tensors become zero-copy numpy views. numpy has no bfloat16 or float8, so
those go through a same-size integer view and ml_dtypes. Tensors on another
device (CUDA) are staged through pinned host buffers: device-to-host before a
save (overlapped with the writes of an async save), host-to-device after a load.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import torch

import globalshard as gs
from globalshard.errors import LayoutError

__all__ = ["HostStaging", "load_device", "numpy_view", "torch_dtype", "unusable"]

#: What a tensor on the meta device is told: it holds no data, to save or to fill.
NO_DATA = ("on the meta device: it holds no data (materialize it first, e.g. model.to_empty(device=...), "
           "then initialize it)")

# torch dtype -> (same-size integer dtype to view through, numpy dtype to view as)
_VIA_INT: dict[torch.dtype, tuple[torch.dtype, np.dtype]] = {
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
    torch.float8_e5m2: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2)),
    torch.float8_e4m3fnuz: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    torch.float8_e5m2fnuz: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
}

_BY_NAME = {
    "bool": torch.bool, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz, "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "complex64": torch.complex64, "complex128": torch.complex128,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a canonical globalshard dtype name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise LayoutError(f"no torch dtype for {name!r}") from None


def _cuda_register(address: int, nbytes: int) -> None:
    """Page-lock host memory for fast device copies (``cudaHostRegister``)."""
    code = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(code) != 0:
        raise LayoutError(f"cudaHostRegister of {nbytes} bytes of the staging pool failed: error {int(code)}")


def _cuda_unregister(address: int, nbytes: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def unusable(t: torch.Tensor) -> str | None:
    """Why ``t`` can be neither saved nor loaded into, if it cannot: on the meta
    device, not strided (sparse, nested), or of a dtype the format does not
    store (spec section 6: quantized, packed sub-byte, ``float8_e8m0fnu``...)."""
    if t.device.type == "meta":
        return NO_DATA
    if t.layout != torch.strided:
        return f"a {t.layout} tensor: only dense (strided) tensors are stored; pass .to_dense()"
    if t.dtype not in _BY_NAME.values():
        return f"dtype {t.dtype} is not one the format stores (spec section 6)"
    return None


def load_device() -> torch.device:
    """Where a load creates a tensor it was given on the meta device, as DCP
    does: the default process group's device (the current CUDA device under
    NCCL), else the CPU."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with a CPU tensor (any strides, any dtype
    globalshard knows). Writing into it writes into the tensor."""
    if tensor.device.type != "cpu":
        raise LayoutError(f"numpy_view needs a CPU tensor, got one on {tensor.device}; stage it with HostStaging")
    t = tensor.detach()
    via = _VIA_INT.get(t.dtype)
    if via is not None:
        return t.view(via[0]).numpy().view(via[1])
    if t.dtype not in _BY_NAME.values():
        raise LayoutError(f"unsupported tensor dtype {t.dtype}")
    return t.numpy()


@dataclass
class HostStaging:
    """Host copies of device tensors for one save or load.

    ``host(t)`` returns ``t`` itself for a CPU tensor, else a pinned host
    buffer: filled from the device (``non_blocking``) when staging for a save,
    copied back by :meth:`finish_load` after a load. Device-agnostic: only
    ``tensor.device`` decides.

    ``overlap=True`` (async saves): the device-to-host copies of CUDA tensors
    run on a side stream, which the tensors' own stream waits for before any
    later work (so training cannot overwrite a tensor before it is copied, and
    the host does not wait); :meth:`staged` names the shards whose buffers are
    still being filled, each with a wait that the background writer calls just
    before writing it. 0-d tensors are copied at once (their values are read
    on the host while planning).
    """

    overlap: bool = False
    #: Host memory to stage device tensors into for a save (an
    #: :class:`~globalshard.AsyncSaver`'s ``host_pool``, page-locked here for
    #: CUDA): reused by every save, and shared with the saver's writer
    #: process, which writes the tensors from there. What does not fit goes
    #: to a buffer of its own, and the pool grows to fit it at the next save.
    pool: Any = None
    #: Bytes this staging asked of the pool (what the next save reserves).
    needed: int = 0
    _pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _syncs: list[Callable[[], None]] = field(default_factory=list)
    _in_flight: list[tuple[int, int, Callable[[], None]]] = field(default_factory=list)  # (address, end, wait)
    _side: dict[torch.device, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pool is not None:
            if torch.cuda.is_available():
                self.pool.set_pinning(_cuda_register, _cuda_unregister)
            self.pool.reserve(self.pool.wanted)  # this save's buffers, from the pool's start

    def buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer to stage a tensor of ``shape`` and ``dtype`` into: in the
        pool when it fits, else one of its own (pinned where CUDA is)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.pool is not None:
            self.needed += -(-nbytes // 64) * 64
            self.pool.wanted = max(self.pool.wanted, self.needed)
            try:
                raw, _ = self.pool.take((nbytes,), np.uint8)
                return torch.from_numpy(raw).view(dtype).reshape(tuple(shape))
            except MemoryError:
                pass
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())

    def host(self, tensor: torch.Tensor, *, for_save: bool) -> torch.Tensor:
        t = tensor.detach()
        if t.device.type == "meta":  # callers name the tensor first; this keeps any other from a silent no-op
            raise LayoutError(f"a tensor of shape {tuple(t.shape)} is {NO_DATA}")
        lazy = t.is_conj() or t.is_neg()  # a conjugate or negative view: its memory holds other values
        if t.device.type == "cpu" and not lazy:
            return t
        if t.device.type == "cpu" and for_save:
            return t.resolve_conj().resolve_neg()
        buf = self.buffer(t.shape, t.dtype) if for_save else torch.empty(
            t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        if not for_save:
            self._pending.append((t, buf))
        elif self.overlap and t.device.type == "cuda" and t.ndim > 0:
            side = self._side.get(t.device)
            if side is None:
                side = self._side[t.device] = torch.cuda.Stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))  # the values as of this call
            with torch.cuda.stream(side):
                buf.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            t.record_stream(side)  # the allocator keeps t's memory until the copy is done
            self._in_flight.append((buf.data_ptr(), buf.data_ptr() + buf.nbytes, done.synchronize))
        else:
            # TODO(limitation): a synchronous save's device-to-host copies complete
            # before its writes start (only async saves overlap them).
            buf.copy_(t, non_blocking=True)
            self._note_sync(t.device)
        return buf

    def _note_sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._syncs.append(done.synchronize)

    def ready(self) -> None:
        """Wait for the staged device-to-host copies that are not overlapped
        (before saving); then make the devices' streams wait for the
        overlapped ones before any later work."""
        for sync in self._syncs:
            sync()
        self._syncs.clear()
        for device, side in self._side.items():
            torch.cuda.current_stream(device).wait_stream(side)

    @classmethod
    def for_save(cls, saver: gs.AsyncSaver | None) -> HostStaging:
        """A save's staging: plain without ``saver``; with one, once the save
        before it is done, into its pool with the copies overlapping the writes."""
        if saver is None:
            return cls()
        saver.wait()  # the save before it may still be writing from the saver's pools
        return cls(overlap=True, pool=saver.host_pool)

    def save(self, shards: Mapping[str, Any], path: Any, saver: gs.AsyncSaver | None, **options: Any) -> None:
        """:func:`globalshard.save` of the staged ``shards``; with ``saver``, its
        ``save``, whose writer waits for each copy still in flight just before
        writing that shard."""
        if saver is None:
            gs.save(shards, path, **options)
        else:
            saver.save(shards, path, staged=self.staged(shards), **options)

    def staged(self, shards: Mapping[str, Any]) -> dict[str, Callable[[], None]]:
        """The shards (name -> ShardedTensor) whose data views a buffer still
        being filled, each with the wait for its copy."""
        if not self._in_flight:
            return {}
        spans = sorted(self._in_flight)
        starts = [lo for lo, _, _ in spans]
        out = {}
        for name, shard in shards.items():
            address = shard.data.__array_interface__["data"][0]
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0 and address < spans[i][1]:
                out[name] = spans[i][2]
        return out

    def wait_all(self) -> None:
        """Wait until every device-to-host copy in flight has landed."""
        for _, _, wait in self._in_flight:
            wait()

    def finish_load(self) -> None:
        """Copy loaded host buffers back to their device tensors."""
        for device_tensor, buf in self._pending:
            device_tensor.copy_(buf, non_blocking=True)
            self._note_sync(device_tensor.device)
        self._pending.clear()
        self.ready()
