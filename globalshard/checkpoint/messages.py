"""The messages between a trainer and its writer process, as JSON.

Plain JSON values pass as they are (tuples become lists); the few other
things a job carries are tagged as an object of one member whose name
starts with ``$``: ``{"$bytes": base64}``, ``{"$metadata": the text of a
metadata.json}``, ``{"$store": what :func:`~globalshard.store.portable`
gives}``, ``{"$error": {"type": ..., "args": [...]}}``, and ``{"$dict": ...}``
for a dict that would otherwise read as a tag. No message carries code: an
error comes back as its type's name and arguments and is raised again only
as one of this package's errors or a built-in exception (anything else as a
:class:`~globalshard.errors.StorageError` naming it).
"""

from __future__ import annotations

import base64
import builtins
import json
import socket
import struct
from typing import Any

from globalshard import errors
from globalshard.errors import StorageError
from globalshard.format.metadata import Metadata, parse_metadata
from globalshard.store import Store, from_portable, portable

__all__ = ["can_send", "decode", "encode", "error_from", "error_to", "receive", "send"]


def can_send(store: Store) -> bool:
    """Whether a message can carry ``store`` to another process."""
    return portable(store) is not None


def _out(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"a message's keys are strings, got {k!r}")
            out[k] = _out(v)
        return {"$dict": out} if len(out) == 1 and next(iter(out)).startswith("$") else out
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Metadata):
        return {"$metadata": value.dumps()}
    if isinstance(value, BaseException):
        return {"$error": error_to(value)}
    if isinstance(value, Store):
        doc = portable(value)
        if doc is None:
            raise TypeError(f"{value} cannot be reached from another process")
        return {"$store": doc}
    raise TypeError(f"a message cannot carry a {type(value).__name__}")


def _in(value: Any) -> Any:
    if isinstance(value, list):
        return [_in(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "$dict":
            return {k: _in(v) for k, v in inner.items()}
        if tag == "$bytes":
            return base64.b64decode(inner)
        if tag == "$metadata":
            return parse_metadata(inner, source="a message from the trainer")
        if tag == "$store":
            return from_portable(inner)
        if tag == "$error":
            return error_from(inner)
    return {k: _in(v) for k, v in value.items()}


def encode(message: Any) -> bytes:
    """``message`` as the bytes of one JSON document.

    Raises:
        TypeError: it holds something no message carries.
    """
    return json.dumps(_out(message), separators=(",", ":")).encode("utf-8")


def decode(data: bytes) -> Any:
    """The message :func:`encode` made ``data`` of."""
    return _in(json.loads(data))


def error_to(error: BaseException) -> dict[str, Any]:
    """An exception as its type's name and its arguments (those that are not
    JSON values as their text)."""
    args: list[Any] = []
    for a in error.args:
        try:
            args.append(_out(a))
        except TypeError:
            args.append(str(a))
    doc = {"type": type(error).__name__, "module": type(error).__module__, "args": args, "text": str(error)}
    if isinstance(error, OSError) and error.filename is not None:  # not among an OSError's args
        doc["filenames"] = [str(error.filename), None if error.filename2 is None else str(error.filename2)]
    return doc


def error_from(doc: dict[str, Any]) -> BaseException:
    """The exception :func:`error_to` described: the same type when it is one
    of this package's errors or a built-in exception, else a
    :class:`~globalshard.errors.StorageError` naming the type."""
    name, module = str(doc.get("type")), doc.get("module")
    home = errors if module == errors.__name__ else builtins if module == "builtins" else None
    cls = getattr(home, name, None) if home is not None else None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        args = [_in(a) for a in doc.get("args", [])]
        names = doc.get("filenames")
        if issubclass(cls, OSError) and isinstance(names, list) and len(names) == 2 and len(args) == 2:
            args += [names[0]] if names[1] is None else [names[0], None, names[1]]
        try:
            return cls(*args)
        except Exception:  # a constructor that wants other arguments
            pass
    return StorageError(f"{name}: {doc.get('text')}")


_LENGTH = struct.Struct("<Q")


def send(sock: socket.socket, message: Any) -> None:
    """Send ``message`` as one frame: its length (8 bytes), then its JSON.

    Raises:
        TypeError: it holds something no message carries (nothing is sent).
        OSError: the other end is gone.
    """
    data = encode(message)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """The next message :func:`send` sent.

    Raises:
        EOFError: the other end closed the socket.
    """
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return decode(_exactly(sock, length))


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise EOFError("the other process closed its end")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
