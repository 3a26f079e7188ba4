"""Placement plans on fake 2-node / 1-node+CXL topologies; mbind application is a no-op on 1 node."""
import errno
import mmap

import pytest

from fake_sys import make_sys, tree
from mixqrt.errors import MixqrtError
from mixqrt.platform import affinity
from mixqrt.runtime.placement import (Placement, apply_placement, format_placement, plan_placement,
                                      role_class)
from mixqrt.platform.topology import topology

MiB = 1 << 20
LAYER_ROLES = ("attn_q", "attn_k", "attn_v", "attn_o", "ffn_gate", "ffn_up", "ffn_down", "norm")


def model_tensors(n_layers=4, embed=64 * MiB):
    ts = [("model.embed_tokens.weight", "embed", embed, None)]
    for i in range(n_layers):
        for r in LAYER_ROLES:
            ts.append((f"model.layers.{i}.{r}", r, 2 * MiB if r.startswith("ffn") else MiB, i))
    ts += [("model.norm.weight", "norm", 4096, None), ("lm_head.weight", "lm_head", 32 * MiB, -1)]
    return ts


def by_name(plan):
    return {p.name: p for p in plan}


def test_role_class():
    assert [role_class(r) for r in ("embed", "attn_v", "ffn_down", "norm", "bias", "lm_head", "x")] == \
        ["embed", "attn", "ffn", "norm", "norm", "lm_head", "other"]


def test_one_node_everything_local():
    t = topology(tree("one_node"))
    ts = model_tensors()
    for policy in ("local", "tiered"):
        plan = plan_placement(ts, t, policy, cpus=[0, 1])
        assert [p.name for p in plan] == [x[0] for x in ts]
        assert {(p.node, p.tier) for p in plan} == {(0, "local")}
        assert [p.nbytes for p in plan] == [x[2] for x in ts]


def test_two_node_local_single_home():
    t = topology(tree("two_node"))
    plan = plan_placement(model_tensors(), t, "local", cpus=[4, 5])  # workers on node 1
    assert {(p.node, p.tier) for p in plan} == {(1, "local")}


def test_two_node_local_layers_follow_threads():
    t = topology(tree("two_node"))
    plan = by_name(plan_placement(model_tensors(n_layers=4), t, "local", cpus=range(8)))
    for i in range(4):
        want = 0 if i < 2 else 1
        assert {plan[f"model.layers.{i}.{r}"].node for r in LAYER_ROLES} == {want}
    assert plan["model.embed_tokens.weight"].node == 0 and plan["lm_head.weight"].node == 0
    assert {p.tier for p in plan.values()} == {"local"}


def test_two_node_local_blocks_weighted_by_cpus():
    t = topology(tree("two_node"))
    plan = by_name(plan_placement(model_tensors(n_layers=8), t, "local", cpus=[0, 1, 2, 4]))
    nodes = [plan[f"model.layers.{i}.attn_q"].node for i in range(8)]
    assert nodes == [0] * 6 + [1] * 2  # 3 CPUs on node 0, 1 on node 1


def test_two_node_tiered_embed_to_remote():
    t = topology(tree("two_node"))
    plan = by_name(plan_placement(model_tensors(), t, "tiered", cpus=[0, 1]))
    e = plan["model.embed_tokens.weight"]
    assert (e.node, e.tier) == (1, "remote")
    rest = [p for n, p in plan.items() if n != "model.embed_tokens.weight"]
    assert {(p.node, p.tier) for p in rest} == {(0, "local")}


def test_cxl_tiered_embed_to_cxl_attention_local():
    t = topology(tree("cxl"))
    plan = plan_placement(model_tensors(), t, "tiered", cpus=[0, 1, 2, 3])
    for p in plan:
        if p.role == "embed":
            assert (p.node, p.tier) == (1, "cxl")
        else:
            assert (p.node, p.tier) == (0, "local"), p
    local = plan_placement(model_tensors(), t, "local", cpus=[0])
    assert {p.node for p in local} == {0}


def test_two_node_cxl_picks_nearest_far_node():
    t = topology(tree("two_node_cxl"))
    e0 = plan_placement(model_tensors(), t, "tiered", cpus=[0])[0]
    e1 = plan_placement(model_tensors(), t, "tiered", cpus=[5])[0]
    assert (e0.node, e0.tier) == (2, "cxl") and (e1.node, e1.tier) == (3, "cxl")


def test_custom_policy_and_capacity_spill(tmp_path):
    # a 100 MiB CXL node: the 64 MiB embedding fits, FFN weights fill the rest, then spill to local
    make_sys(tmp_path, [("0-1", 1 << 24, [10, 20]), ("", 100 * 1024, [20, 10])], online="0-1")
    t = topology(tmp_path)
    plan = plan_placement(model_tensors(n_layers=12), t, {"embed": "far", "ffn": "far"}, cpus=[0, 1])
    far = [p for p in plan if p.node == 1]
    assert far[0].role == "embed" and all(p.role.startswith("ffn") or p.role == "embed" for p in far)
    assert sum(p.nbytes for p in far) <= 100 * MiB
    assert any(p.role.startswith("ffn") and p.node == 0 for p in plan)  # spilled
    assert all(p.node == 0 for p in plan if p.role.startswith("attn"))


def test_embed_too_big_for_cxl_stays_local(tmp_path):
    make_sys(tmp_path, [("0-1", 1 << 24, [10, 20]), ("", 1024, [20, 10])], online="0-1")
    plan = plan_placement(model_tensors(), topology(tmp_path), "tiered", cpus=[0])
    assert plan[0].role == "embed" and (plan[0].node, plan[0].tier) == (0, "local")


@pytest.mark.parametrize("tensors,policy", [
    ([("a", "embed", 10)], "local"),                 # missing layer
    ([("a", "embed", -1, None)], "local"),           # negative size
    ([("a", "embed", 10, None)], "fastest"),         # unknown policy
    ([("a", "embed", 10, None)], {"embed": "moon"}), # unknown tier
    ([("a", "embed", 10, None)], 3),
])
def test_plan_rejects(tensors, policy):
    with pytest.raises(MixqrtError):
        plan_placement(tensors, topology(tree("two_node")), policy, cpus=[0])


def test_format_placement():
    t = topology(tree("cxl"))
    plan = plan_placement(model_tensors(n_layers=2), t, "tiered", cpus=[0])
    text = format_placement(plan, t)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["role", "tensors", "node", "tier", "bytes"]
    embed = next(line for line in lines if line.startswith("embed"))
    assert embed.split()[1:4] == ["1", "1", "cxl"] and "67,108,864" in embed
    attn_q = next(line for line in lines if line.startswith("attn_q"))
    assert attn_q.split()[1:4] == ["2", "0", "local"]
    assert "node 1: 67,108,864 bytes" in text and "of 64.0 GiB" in text
    assert "no-op" in format_placement(plan_placement(model_tensors(1), topology(tree("one_node")), cpus=[0]),
                                       topology(tree("one_node")))
    assert "no tensors" in format_placement([])


# --- applying plans with mbind ---

PAGE = mmap.PAGESIZE


def test_apply_is_noop_on_one_node():
    t = topology(tree("one_node"))
    mm = mmap.mmap(-1, 8 * PAGE)
    plan = [Placement("a", "embed", 0, "local", 4 * PAGE), Placement("b", "attn_q", 0, "local", 4 * PAGE)]
    res = apply_placement(mm, [(0, 4 * PAGE), (4 * PAGE, 4 * PAGE)], plan, t)
    assert [r.status for r in res] == ["noop", "noop"]
    mm.close()


def test_apply_binds_and_reports_errors(tmp_path):
    """Fake 2-node plan on this machine: node 0 exists (mbind succeeds), node 7 does not (EINVAL)."""
    if not affinity.numa_syscalls_available():
        pytest.skip("mbind syscall number unknown on this machine")
    t = topology(tree("two_node"))
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * (64 * PAGE // 256))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    plan = [Placement("a", "embed", 0, "local", 10 * PAGE + 100),
            Placement("b", "attn_q", 7, "remote", 8 * PAGE),
            Placement("c", "norm", 0, "local", 100)]
    spans = {"a": (0, 10 * PAGE + 100), "b": (20 * PAGE, 8 * PAGE), "c": (40 * PAGE + 10, 100)}
    res = apply_placement(mm, spans, plan, t, touch=True)
    a, b, c = res
    if a.status == "error" and a.errno in (errno.ENOSYS, errno.EPERM):
        pytest.skip(f"mbind refused here: {a.detail}")
    assert a.status == "ok" and a.nbytes == 10 * PAGE and a.addr % PAGE == 0
    assert b.status == "error" and b.errno == errno.EINVAL and b.detail
    assert c.status == "skipped"
    assert mm[:4] == bytes([0, 1, 2, 3])  # mapping still intact
    mm.close()  # no exported buffers left behind


def test_apply_anonymous_and_address_tuple():
    if not affinity.numa_syscalls_available():
        pytest.skip("mbind syscall number unknown on this machine")
    t = topology(tree("two_node"))
    mm = mmap.mmap(-1, 16 * PAGE)
    addr, size = affinity.buffer_address(mm)
    plan = [Placement("x", "ffn_up", 0, "local", 16 * PAGE)]
    res = apply_placement((addr, size), [(0, 16 * PAGE)], plan, t, touch=True)
    assert res[0].status in ("ok", "error") and (res[0].status == "ok" or res[0].errno)
    mm.close()


def test_apply_rejects_bad_spans():
    t = topology(tree("two_node"))
    mm = mmap.mmap(-1, 4 * PAGE)
    plan = [Placement("x", "ffn_up", 0, "local", PAGE)]
    with pytest.raises(MixqrtError, match="outside"):
        apply_placement(mm, [(3 * PAGE, 2 * PAGE)], plan, t)
    with pytest.raises(MixqrtError, match="no span"):
        apply_placement(mm, {}, plan, t)
    with pytest.raises(MixqrtError, match="spans for"):
        apply_placement(mm, [], plan, t)
    mm.close()


def test_mbind_rejects_unaligned():
    with pytest.raises(MixqrtError, match="page-aligned"):
        affinity.mbind(PAGE + 1, PAGE, [0])


def test_page_align():
    assert affinity.page_align_inward(PAGE + 1, 3 * PAGE) == (2 * PAGE, 2 * PAGE)
    assert affinity.page_align_inward(PAGE, PAGE - 1) == (PAGE, 0)
    assert affinity.page_align_outward(PAGE + 1, PAGE) == (PAGE, 2 * PAGE)
