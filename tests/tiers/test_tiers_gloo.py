"""The fast tier on real process groups: 4 simulated nodes x 2 gloo ranks train
the demo's Llama, each node's tier a directory only its ranks open, the
persistent tier on a moto S3 server; nodes lost, ranks killed mid-save,
recovery onto another TP and DP size with every tensor equal to a plain load."""

import shutil
import sys

import pytest
import tier_jobs
from repo import EXAMPLES
from torch_harness import run, run_tolerating_deaths

sys.path.insert(0, EXAMPLES)  # the ranks import the demo's trainer (they get this process's path)

CFG = {"global_batch": 24, "micro_batch": 6, "total_steps": 4, "layers": 2}  # 24: DP of 2, 3 and 4 divide it
TRAIN = {"tp": 4, "dp": 2}  # 8 ranks: 4 nodes of 2
RESUME = {"tp": 2, "dp": 3}  # 6 ranks: 3 nodes of 2, another TP and DP


def job_args(local, s3, nodes, persistent, replicas=1):
    spec, _, _ = s3
    return dict(cfg=CFG, local=str(local), nodes=nodes, persistent=persistent, kvstore=spec, per_node=2,
                replicas=replicas)


def ok(outcomes):
    bad = [o for o in outcomes if not o.get("ok")]
    assert not bad, bad[0].get("trace") or bad[0]
    return [o["value"] for o in outcomes]


def check_resumed(values, *, step, persistent_bytes=None):
    for v in values:
        assert v["step"] == step, v
        assert v.get("unequal", []) == [], v["unequal"]
        assert v.get("tensors_compared", 1) > 0
    if persistent_bytes is not None:
        assert sum(v["bytes_persistent"] for v in values) == persistent_bytes


@pytest.fixture(scope="module")
def trained(tmp_path_factory, s3):
    """Steps 1 and 2 saved into the tiers of 4 nodes and drained to S3, once for the module."""
    root = tmp_path_factory.mktemp("trained")
    values = ok(run(8, "tier_jobs:train_job", str(root / "o"), topo=TRAIN, saves=[1, 2],
                    **job_args(root / "local", s3, [0, 1, 2, 3], "tiers-trained")))
    for rank, v in enumerate(values):  # each rank opened its own node's directory, never another's
        assert v["opened"] == [f"node{rank // 2}"], (rank, v["opened"])
        assert v["persisted"] == 2
    return root / "local"


@pytest.fixture
def local(tmp_path, trained):
    """This test's own copy of the nodes' directories."""
    shutil.copytree(trained, tmp_path / "local")
    return tmp_path / "local"


def test_a_lost_node_comes_back_from_its_replicas_onto_another_tp_and_dp(tmp_path, s3, local):
    shutil.rmtree(local / "node2")  # node 2 and its disk are gone
    values = ok(run(6, "tier_jobs:resume_job", str(tmp_path / "o"), topo=RESUME, until=3,
                    **job_args(local, s3, [0, 1, 3], "tiers-trained")))
    check_resumed(values, step=2, persistent_bytes=0)  # all of it from the surviving nodes' copies
    assert sum(v["bytes_peer"] for v in values) > 0
    for rank, v in enumerate(values):
        assert v["opened"] == [f"node{[0, 1, 3][rank // 2]}"], (rank, v["opened"])


def test_two_adjacent_nodes_lost_with_one_replica_read_only_their_arrays_from_s3(tmp_path, s3, local):
    layout = tier_jobs.inspect_tiers(str(local))
    assert all(layout[f"node{n}"]["iter_0000002"] is True for n in range(4))
    surviving = tier_jobs.holds(str(local), "node0", "iter_0000002") | tier_jobs.holds(str(local), "node3",
                                                                                        "iter_0000002")
    lost = (tier_jobs.holds(str(local), "node1", "iter_0000002") | tier_jobs.holds(str(local), "node2",
                                                                                   "iter_0000002")) - surviving
    assert lost  # node 1's own arrays: held by nodes 1 and 2 only
    shutil.rmtree(local / "node1")
    shutil.rmtree(local / "node2")
    values = ok(run(4, "tier_jobs:resume_job", str(tmp_path / "o"), topo={"tp": 2, "dp": 2}, until=3,
                    **job_args(local, s3, [0, 3], "tiers-trained")))
    check_resumed(values, step=2)
    assert set().union(*(v["paths_persistent"] for v in values)) == lost  # exactly what no surviving node holds
    assert all(v["bytes_local"] + v["bytes_peer"] > 0 for v in values)


@pytest.mark.parametrize("phase, saver", [("local write", None), ("replication", None), ("drain", None),
                                          ("replication", "process")])
def test_a_rank_killed_mid_save_leaves_the_previous_step_whole_on_every_tier(tmp_path, s3, phase, saver):
    # With saver="process", the rank dies in the save's background, while the others train on.
    args = job_args(tmp_path / "local", s3, [0, 1, 2, 3], f"tiers-{tmp_path.name}")
    outcomes = run_tolerating_deaths(8, "tier_jobs:train_job", str(tmp_path / "o"), topo=TRAIN, saves=[1, 2],
                                     kill={"step": 2, "rank": 3, "phase": phase}, saver=saver, **args)
    assert outcomes[3].get("type") == "killed", outcomes[3]
    layout = tier_jobs.inspect_tiers(str(tmp_path / "local"))
    for node, steps in layout.items():
        assert steps.get("iter_0000001") is True, (node, steps)  # the previous step, whole on every node
        assert steps.get("iter_0000002") in (None, True), (node, steps)  # never a half copy
    values = ok(run(8, "tier_jobs:resume_job", str(tmp_path / "o"), topo=TRAIN, until=3, **args))
    expected = 2 if phase == "drain" else 1  # killed while draining: step 2 is whole in the tier copies
    assert all(v["step"] == expected for v in values), [v["step"] for v in values]
    if phase != "drain":
        check_resumed(values, step=1)


def test_asynchronous_saves_recover_onto_another_layout_equal_to_plain_saves_of_the_same_steps(tmp_path, s3):
    """Each rank's writer process writes its tier copies while training goes on
    (step 3 runs while step 2 is written); after a node is lost, the recovery
    at another TP and DP equals, tensor for tensor, a plain load of a
    synchronous save made at the same step."""
    reference = str(tmp_path / "reference")
    ok(run(8, "tier_jobs:train_job", str(tmp_path / "o"), topo=TRAIN, saves=[1, 2], until=3, saver="process",
           reference=reference, **job_args(tmp_path / "local", s3, [0, 1, 2, 3], f"tiers-{tmp_path.name}")))
    shutil.rmtree(tmp_path / "local" / "node2")
    values = ok(run(6, "tier_jobs:resume_job", str(tmp_path / "o"), topo=RESUME, until=3, reference=reference,
                    **job_args(tmp_path / "local", s3, [0, 1, 3], f"tiers-{tmp_path.name}")))
    check_resumed(values, step=2, persistent_bytes=0)
