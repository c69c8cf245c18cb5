"""holdings.json: the commit record of a tier copy (spec/FORMAT.md section
5.3), a root that holds some of a checkpoint's paths."""

from __future__ import annotations

import json
from dataclasses import dataclass

from globalshard.errors import MetadataError, format_problems
from globalshard.format.metadata import Metadata, parse_metadata
from globalshard.format.strict_json import json_type, loads, short

__all__ = ["HOLDINGS_FILE", "HOLDINGS_FORMAT", "Holdings", "parse_holdings"]

HOLDINGS_FILE = "holdings.json"
HOLDINGS_FORMAT = "globalshard-holdings"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class Holdings:
    """A tier copy: the checkpoint it is a copy of, the paths it holds, the node that wrote it."""

    metadata: Metadata
    holds: frozenset[str]
    node: int

    def dumps(self) -> str:
        """The text of holdings.json."""
        doc = {"format": HOLDINGS_FORMAT, "version": _VERSION, "metadata": self.metadata.to_json(),
               "holds": sorted(self.holds), "node": self.node}
        return json.dumps(doc, separators=(",", ":")) + "\n"


def parse_holdings(data: bytes | str, *, source: str = HOLDINGS_FILE) -> Holdings:
    """Parse and check a holdings.json (spec section 5.3).

    Raises:
        MetadataError: naming the JSON path of every problem.
    """
    doc = loads(data, source, strict_integers=True)
    problems: list[str] = []
    if not isinstance(doc, dict) or set(doc) != {"format", "version", "metadata", "holds", "node"}:
        got = sorted(doc) if isinstance(doc, dict) else json_type(doc)
        raise MetadataError(f"{source}: $ must be an object with exactly format, version, metadata, holds and "
                            f"node, got {got}")
    if doc["format"] != HOLDINGS_FORMAT:
        problems.append(f"$.format: must be {HOLDINGS_FORMAT!r}, got {short(doc['format'])}")
    if type(doc["version"]) is not int or doc["version"] != _VERSION:
        problems.append(f"$.version: this library reads version {_VERSION}, got {short(doc['version'])}")
    if type(doc["node"]) is not int or doc["node"] < 0:
        problems.append(f"$.node: must be a non-negative integer, got {short(doc['node'])}")
    if problems:
        raise MetadataError(format_problems(f"{source} is invalid", problems))
    try:
        metadata = parse_metadata(json.dumps(doc["metadata"]), source=f"{source} $.metadata")
    except MetadataError as e:
        raise MetadataError(f"{source}: $.metadata is not a valid metadata document: {e}") from None
    own = set(metadata.paths())
    holds = doc["holds"]
    if not isinstance(holds, list):
        raise MetadataError(f"{source}: $.holds must be an array, got {json_type(holds)}")
    for i, path in enumerate(holds):
        if not isinstance(path, str) or path not in own:
            problems.append(f"$.holds[{i}]: {short(path)} is not a path the checkpoint stores itself")
    if len(set(map(str, holds))) != len(holds):
        problems.append("$.holds: a path is listed twice")
    if problems:
        raise MetadataError(format_problems(f"{source} is invalid", problems))
    return Holdings(metadata, frozenset(holds), doc["node"])

