"""numpy views of torch tensors, so the core reads and writes torch memory directly.

CPU tensors become zero-copy numpy views. numpy has no bfloat16 or float8, so
those go through a same-size integer view and ml_dtypes. Tensors on another
device (CUDA) are staged through pinned host buffers: device-to-host before a
save, host-to-device after a load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import torch

from globalshard.errors import LayoutError

__all__ = ["HostStaging", "numpy_view", "torch_dtype"]

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
    """

    _pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _syncs: list[Callable[[], None]] = field(default_factory=list)

    def host(self, tensor: torch.Tensor, *, for_save: bool) -> torch.Tensor:
        t = tensor.detach()
        if t.device.type == "cpu":
            return t
        # TODO(limitation): device-to-host copies complete before the writes
        # start; they are not overlapped with I/O tensor by tensor.
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        if for_save:
            buf.copy_(t, non_blocking=True)
            self._note_sync(t.device)
        else:
            self._pending.append((t, buf))
        return buf

    def _note_sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._syncs.append(lambda: torch.cuda.synchronize(device))

    def ready(self) -> None:
        """Wait for staged device-to-host copies (before saving)."""
        for sync in self._syncs:
            sync()
        self._syncs.clear()

    def finish_load(self) -> None:
        """Copy loaded host buffers back to their device tensors."""
        for device_tensor, buf in self._pending:
            device_tensor.copy_(buf, non_blocking=True)
            self._note_sync(device_tensor.device)
        self._pending.clear()
        self.ready()
