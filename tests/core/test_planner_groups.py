"""Save planning over rank groups: ranks whose shard lists differ only in replica
ids are planned once, and ranks exchange each distinct list once.

The writer rule is checked by replaying it on the plan (no second planner):
regions largest first, each to the least-loaded rank that holds a containing
region, ties to the lower rank.
"""

import dataclasses
import json
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import globalshard as gs
from globalshard import Box, planner
from globalshard.dtypes import numpy_dtype
from globalshard.planner import describe_shards, group_descriptions, group_ranks
from globalshard.testing.strategies import layouts, make_shard, shapes


@st.composite
def replicated_ranks(draw):
    """A few tensors laid out over a few ranks, repeated by 1-3 data-parallel copies
    (copies get replica ids > 0), with the ranks shuffled so groups interleave."""
    base = [[] for _ in range(draw(st.integers(1, 3)))]
    for n in range(draw(st.integers(1, 3))):
        shape = draw(shapes(min_dims=0, max_dims=2, max_side=8))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
        value = np.zeros(shape, numpy_dtype(dtype))
        for spec in draw(layouts(shape)):
            base[draw(st.integers(0, len(base) - 1))].append(gs.ShardInfo.of(make_shard(f"t{n}", spec, value)))
    per_rank = []
    for copy in range(draw(st.integers(1, 3))):
        for shards in base:
            per_rank.append([dataclasses.replace(i, replica_id=i.replica_id + 3 * copy) for i in shards])
    order = draw(st.permutations(range(len(per_rank))))
    return [per_rank[i] for i in order]


def over_the_wire(per_rank):
    """What every rank gets after the two all-gathers of a real save (through JSON)."""
    described = [json.loads(json.dumps(describe_shards(shards))) for shards in per_rank]
    digests = [d for d, _, _ in described]
    schemas = {}
    for d, schema, _ in described:
        schemas.setdefault(d, schema)  # only the first rank of each digest sends its list
    return group_descriptions(digests, schemas, [r for _, _, r in described])


def replay_writer_rule(plan, per_rank):
    load = [0] * len(per_rank)
    for w in sorted(plan.writes, key=lambda w: (-w.nbytes, w.key, w.box.offset)):
        holders = sorted({rank for rank, shards in enumerate(per_rank) for info in shards if info.key == w.key
                          for reg in info.regions if reg.global_box.contains(w.box)})
        assert w.rank in holders
        least = min(load[r] for r in holders)
        assert w.rank == min(r for r in holders if load[r] == least), (w, holders, load)
        load[w.rank] += w.nbytes


@given(replicated_ranks())
def test_property_groups_plan_like_ranks_and_survive_the_wire(per_rank):
    plan = gs.SavePlanner().plan(per_rank)
    wire = gs.SavePlanner().plan_groups(over_the_wire(per_rank), len(per_rank))
    assert wire == plan
    # Each group's ranks really share a list; every rank is in exactly one group.
    groups = group_ranks(per_rank)
    assert sorted(r for g in groups for r in g.ranks.tolist()) == list(range(len(per_rank)))
    for g in groups:
        for row, rank in zip(g.replicas, g.ranks):
            assert [dataclasses.replace(i, replica_id=0) for i in per_rank[rank]] == \
                   [dataclasses.replace(i, replica_id=0) for i in g.shards]
            assert row.tolist() == [i.replica_id for i in per_rank[rank]]
    # Every stored element written once, by a rank holding it, chosen by the rule.
    for w in plan.writes:
        holder = per_rank[w.rank][w.shard].regions[w.region].global_box
        assert per_rank[w.rank][w.shard].key == w.key and holder.contains(w.box)
    replay_writer_rule(plan, per_rank)


def _plan_or_message(per_rank, pack_below=0):
    try:
        return gs.SavePlanner().plan(per_rank, pack_below=pack_below)
    except gs.LayoutError as e:
        return str(e)


@given(replicated_ranks(), st.data())
def test_property_the_whole_tensor_fast_path_plans_as_the_general_one(per_rank, data):
    # A key one shard holds whole takes a shorter path through the planner: with
    # replica ids redrawn (gaps, copies left at 0) and packing on or off, the
    # plan, or the message, must be what the general path gives.
    per_rank = [[dataclasses.replace(i, replica_id=data.draw(st.sampled_from([i.replica_id, 0, 1])))
                 for i in shards] for shards in per_rank]
    pack_below = data.draw(st.sampled_from([0, 64, 1 << 20]))
    fast = _plan_or_message(per_rank, pack_below)
    with mock.patch("globalshard.planner._whole_from_one", return_value=None):
        assert _plan_or_message(per_rank, pack_below) == fast


def test_the_fast_path_takes_whole_tensors():
    # The property above compares two paths: it must not compare the general one with itself.
    whole = gs.ShardInfo("w", "float32", (4, 2), (4, 2), (gs.Region(Box((0, 0), (4, 2)), Box((0, 0), (4, 2))),))
    half = gs.ShardInfo("h", "float32", (4, 2), (2, 2), (gs.Region(Box((0, 0), (2, 2)), Box((0, 0), (2, 2))),))
    with mock.patch("globalshard.planner._whole_from_one", wraps=planner._whole_from_one) as spy:
        plan = gs.SavePlanner().plan([[whole, half], [dataclasses.replace(half, regions=(gs.Region(
            Box((0, 0), (2, 2)), Box((2, 0), (2, 2))),))]])
    assert [c.args[0] for c in spy.call_args_list] == ["w"] and [r.path for r in plan.metadata.tensors["w"].regions] \
        == [f"saves/{'0' * 32}/arrays/w/0"]


def test_a_whole_sized_box_off_the_origin_is_not_taken_as_whole():
    # ShardInfo is plain data (a wire format): the planner may not trust its boxes.
    off = gs.ShardInfo("w", "float32", (4, 2), (4, 2), (gs.Region(Box((0, 0), (4, 2)), Box((1, 0), (4, 2))),))
    message = _plan_or_message([[off]])
    assert isinstance(message, str) and "'w'" in message
    with mock.patch("globalshard.planner._whole_from_one", return_value=None):
        assert _plan_or_message([[off]]) == message


def tp_dp(tp, dp, rows=16):
    n = rows // tp
    return [[gs.ShardInfo("w", "float32", (rows, 4), (n, 4),
                          (gs.Region(Box((0, 0), (n, 4)), Box(((r % tp) * n, 0), (n, 4))),), r // tp)]
            for r in range(tp * dp)]


def test_replicas_sharing_the_writing_group_by_tp_slice():
    per_rank = tp_dp(2, 4)
    groups = group_ranks(per_rank)
    assert [g.ranks.tolist() for g in groups] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    plan = gs.SavePlanner().plan(per_rank)
    assert sorted(w.rank for w in plan.writes) == [0, 1]  # one region per TP slice, lowest rank on a tie
    replay_writer_rule(plan, per_rank)


def test_copies_left_at_replica_id_0_are_named():
    per_rank = tp_dp(2, 3)
    per_rank = [[dataclasses.replace(i, replica_id=0) for i in shards] for shards in per_rank]
    with pytest.raises(gs.LayoutError, match=r"rank 0 holds .* and rank 2 holds .* \(and 1 more ranks\) "
                                             r"\(if these are copies"):
        gs.SavePlanner().plan(per_rank)


def test_a_description_that_does_not_add_up_is_refused():
    digest, schema, runs = describe_shards(tp_dp(1, 1)[0])
    with pytest.raises(gs.LayoutError, match="rank 1 sent 2 replica ids for 1 shards"):
        group_descriptions([digest, digest], {digest: schema}, [runs, [[0, 2]]])
    with pytest.raises(gs.LayoutError, match="no rank sent the shard list"):
        group_descriptions([digest, "f" * 32], {digest: schema}, [runs, runs])


def test_digest_depends_on_everything_but_replica_ids():
    shards = tp_dp(2, 1)[0]
    base = describe_shards(shards)[0]
    assert describe_shards([dataclasses.replace(shards[0], replica_id=5)])[0] == base
    for change in ({"key": "v"}, {"dtype": "bfloat16"}, {"global_shape": (16, 5)}):
        assert describe_shards([dataclasses.replace(shards[0], **change)])[0] != base
    moved = gs.Region(Box((0, 0), (8, 4)), Box((8, 0), (8, 4)))
    assert describe_shards([dataclasses.replace(shards[0], regions=(moved,))])[0] != base
