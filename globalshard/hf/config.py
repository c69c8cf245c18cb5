"""A mapping's ``config``: the ``config.json`` written beside exported files.

Its values are JSON, or directives read from what the export writes (the
Hugging Face names and shapes of its tensors) and from the mapping's
``params``. Pure: nothing is read but the arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from globalshard.hf.naming import ExportError, NameMapping
from globalshard.hf.patterns import compile_key
from globalshard.hf.pieces import HfTensor, _hf_shapes


def hf_config(mapping: NameMapping, pieces: Sequence[HfTensor], out_dtype: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``config.json`` ``mapping`` describes for these tensors, or None.

    A name in a directive may hold ``{field}``s (``model.layers.{layer}.mlp.gate.weight``):
    ``$present`` then asks whether any tensor has such a name, ``$shape``
    and ``$dtype`` read every such tensor, which must agree, and ``$indices``
    lists the values its one field takes (the layers that have it). ``$present``,
    ``$absent``, ``$param`` (a number other than 0) and ``$equal`` (two values)
    choose between ``then`` and ``else``; ``$error`` (in a branch) refuses the
    export with its message; ``$range`` is ``[0, 1, ..., n - 1]``; ``$cycle``
    repeats its list's values, in order, until there are ``count`` of them.
    """
    if mapping.config is None:
        return None
    shapes = _hf_shapes(pieces)
    where = mapping.where

    def named(arg: Any, at: str) -> list[str]:
        if not isinstance(arg, str):
            raise ExportError(f"{where}: {at}: a directive names a Hugging Face tensor, got {arg!r}")
        pattern = compile_key(arg, at)
        return sorted(n for n in shapes if pattern.fullmatch(n))

    def agreed(values: dict[str, Any], arg: str, at: str) -> Any:
        if not values:
            raise ExportError(f"{where}: {at} reads {arg!r}, which the export does not write")
        if len(set(values.values())) > 1:
            raise ExportError(f"{where}: {at}: the tensors named {arg!r} disagree: {values}")
        return next(iter(values.values()))

    def chosen(v: dict[str, Any], holds: Any, kind: str, at: str) -> Any:
        """``holds`` itself, or with ``then`` and ``else`` the branch it chooses (truthy: ``then``)."""
        if "then" not in v and "else" not in v:
            return holds
        if "then" not in v or "else" not in v:
            raise ExportError(f"{where}: {at}: {kind} with 'then' needs 'else' too, and the reverse")
        return value(v["then"], f"{at}.then") if holds else value(v["else"], f"{at}.else")

    def divided(v: dict[str, Any], n: Any, what: str, at: str) -> Any:
        """``n`` divided by ``v["divide"]`` when given: a count, a params name, or a directive
        (another tensor's size); exactly, else an error naming ``what`` ``n`` is."""
        if "divide" not in v:
            return n
        d = value(v["divide"], f"{at}.divide") if isinstance(v["divide"], dict) else \
            mapping._count(v, "divide", at)
        if not isinstance(n, int) or n % d:
            raise ExportError(f"{where}: {at}: {what}{n} does not divide by {d}")
        return n // d

    def whole(n: Any, at: str, needs: str) -> int:
        """``n`` when it is a whole number (a count), else an error at ``at`` saying what ``needs`` one."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ExportError(f"{where}: {at}: {needs}, got {n!r}")
        return n

    def value(v: Any, at: str) -> Any:
        if isinstance(v, list):
            return [value(x, f"{at}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            return v
        directive = [k for k in v if k.startswith("$")]
        if not directive:
            return {k: value(x, f"{at}.{k}") for k, x in v.items()}
        kind, arg = directive[0], v[directive[0]]
        if kind == "$param":
            got = divided(v, mapping._param(arg, f"{where}: {at} needs params.{arg}"), f"params.{arg} ", at)
            return chosen(v, got, kind, at)  # divided: top_k per group of experts
        if kind == "$error":  # in a branch of $present/$absent: a model the architecture cannot hold
            raise ExportError(f"{where}: {at}: {arg}")
        if kind in ("$present", "$absent"):
            return chosen(v, bool(named(arg, at)) == (kind == "$present"), kind, at)
        if kind == "$equal":
            if not isinstance(arg, list) or len(arg) != 2:
                raise ExportError(f"{where}: {at}: $equal compares a list of two values, got {arg!r}")
            return chosen(v, value(arg[0], f"{at}[0]") == value(arg[1], f"{at}[1]"), kind, at)
        if kind == "$range":
            return list(range(whole(value(arg, f"{at}.$range"), at, "$range counts up to a whole number")))
        if kind == "$cycle":
            n = whole(value(v.get("count"), f"{at}.count"), at, "$cycle needs a whole number as its count")
            if not isinstance(arg, list) or not arg:
                raise ExportError(f"{where}: {at}: $cycle repeats a list of values, got {arg!r}")
            values = value(arg, f"{at}.$cycle")
            return [values[i % len(values)] for i in range(n)]
        if kind == "$count":
            return len(named(arg, at))
        if kind == "$indices":
            pattern = compile_key(arg, at) if isinstance(arg, str) else None
            if pattern is None or pattern.groups != 1:
                raise ExportError(f"{where}: {at}: $indices names tensors with one {{field}}, got {arg!r}")
            found = {m.group(1) for n in shapes if (m := pattern.fullmatch(n))}
            return sorted(int(i) for i in found) if all(i.isdigit() for i in found) else sorted(found)
        if kind == "$dtype":
            return agreed({n: out_dtype[n] for n in named(arg, at)}, arg, at)
        if kind == "$shape":
            axis = int(v.get("axis", 0))
            n = agreed({name: shapes[name][axis] for name in named(arg, at) if axis < len(shapes[name])}, arg, at)
            return divided(v, n, "", at)
        raise ExportError(f"{where}: {at}: unknown directive {kind!r}")

    return {k: value(v, f"config.{k}") for k, v in mapping.config.items()}
