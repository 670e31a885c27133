"""Bytes on the wire (course_lib.comms): the HLO parser on every printed form, the ring formulas, and the
predictions from shapes against the compiled programs of the strategies (8 simulated CPU devices)."""

import math

import jax
import pytest

from course_lib import comms, model, steps, strategies

ENTRY = "ENTRY %main (p: f32[8]) -> f32[8] {\n"


def hlo(*instructions: str) -> str:
    return ENTRY + "".join(f"  {i}\n" for i in instructions) + "}\n"


def test_ring_formulas():
    assert comms.ring_bytes("all-reduce", 1000, 4) == 1500
    assert comms.ring_bytes("all-gather", 1000, 4) == 750
    assert comms.ring_bytes("reduce-scatter", 1000, 4) == 750
    assert comms.ring_bytes("all-to-all", 1000, 4) == 750
    assert comms.ring_bytes("collective-permute", 1000, 4) == 1000
    assert comms.ring_bytes("all-reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        comms.ring_bytes("broadcast", 1, 2)


MESH = {"data": 4, "model": 2}


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("replica_groups=mesh['data'=4,'model'=2] {'model'}", ("model",)),
        ("replica_groups=mesh['data'=4,'model'=2] {'data'}", ("data",)),
        ("replica_groups=mesh['data'=4,'model'=2] {'data','model'}", ("data", "model")),
        ("replica_groups=[4,2]<=[8]", ("model",)),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ("data",)),
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("model",)),
        ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("data",)),
        ("replica_groups={}", ("data", "model")),
    ],
)
def test_every_replica_group_form_names_its_mesh_axes(groups, axes):
    text = hlo(f"%ar = f32[16,128]{{1,0}} all-reduce(%x), channel_id=1, {groups}, to_apply=%add")
    (c,) = comms.collectives(text, MESH)
    n = 8 if len(axes) == 2 else MESH[axes[0]]
    assert c.axes == axes and c.group_size == n and c.size_bytes == 16 * 128 * 4
    assert c.sent_bytes == pytest.approx(2 * (n - 1) / n * 16 * 128 * 4)


def test_tuple_async_reduce_scatter_and_permute_are_sized():
    text = hlo(
        "%ar = (f32[32]{0}, f32[3,3,3,32]{3,2,1,0}, f32[]) all-reduce(%a, %b, %c), replica_groups=[1,8]<=[8]",
        "%ags = (f32[1,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%x), dimensions={0}, replica_groups=[1,8]<=[8]",
        "%agd = f32[8,4]{1,0} all-gather-done(%ags)",
        "%rs = f32[1,4]{1,0} reduce-scatter(%y), dimensions={0}, replica_groups=[1,8]<=[8], to_apply=%add",
        "%cp = f32[8,4]{1,0} collective-permute(%z), source_target_pairs="
        + "{"
        + ",".join(f"{{{i},{(i + 1) % 8}}}" for i in range(8))
        + "}",
    )
    ar, ag, rs, cp = comms.collectives(text, {"data": 8})
    assert ar.size_bytes == (32 + 3 * 3 * 3 * 32 + 1) * 4 and len(ar.shapes) == 3
    assert (
        ag.kind == "all-gather" and ag.size_bytes == 8 * 4 * 4
    )  # sized by the -done: the gathered result
    assert rs.size_bytes == 8 * 4 * 4  # the full operand: the result times 8
    assert rs.sent_bytes == pytest.approx(7 / 8 * 128)
    assert cp.kind == "collective-permute" and cp.axes == ("data",) and cp.sent_bytes == 128
    assert comms.total_sent([ar, ag, rs, cp]) == pytest.approx(
        sum(c.sent_bytes for c in (ar, ag, rs, cp))
    )


def test_groups_not_written_are_every_device():
    (c,) = comms.collectives(hlo("%ar = f32[8]{0} all-reduce(%x), to_apply=%add"), MESH)
    assert c.axes == ("data", "model") and c.group_size == 8


def test_refuses_what_it_cannot_count():
    loop = (
        ENTRY
        + "  %w = f32[8] while(%p), condition=%cond, body=%body\n}\n"
        + "%body (q: f32[8]) -> f32[8] {\n  %ar = f32[8]{0} all-reduce(%q), replica_groups=[1,8]<=[8]\n}\n"
    )
    with pytest.raises(ValueError, match="inside the while loop body"):
        comms.collectives(loop, {"data": 8})
    with pytest.raises(ValueError, match="sub-axes"):
        comms.collectives(
            hlo("%ar = f32[8]{0} all-reduce(%x), replica_groups=mesh['data'=8] {'data':(1)2}"),
            {"data": 8},
        )


def _compiled(key, devices, mesh_shape=None, precision="float32"):
    g, p = model.init_model(jax.random.key(0), model.TINY)
    opt = steps.make_optimizer()
    s = strategies.build(key, g, p, opt, devices, mesh_shape, precision=precision)
    state = s.place_state(steps.init_state(p, opt))
    batch = s.batches(config_data(), jax.random.key(1), 1, 32)[0]
    return s, s.lower(state, batch).compile()


def config_data():
    from course_lib import data

    return data.SyntheticImages(image_size=16)


@pytest.mark.parametrize(
    "key, n, mesh_shape",
    [
        ("pmap", 8, None),
        ("sharded_jit", 8, None),
        ("shard_map", 8, None),
        ("shard_map", 8, (2, 4)),
        ("shard_map", 2, None),
        ("shard_map_pairs", 8, None),
        ("shard_map_article", 8, None),
        ("fsdp", 8, None),
        ("fsdp", 4, None),
        ("fsdp", 1, None),
    ],
)
def test_predicted_from_shapes_equals_the_compiled_program(report, key, n, mesh_shape):
    s, compiled = _compiled(key, report.devices[:n], mesh_shape)
    measured = comms.collectives(compiled.as_text(), s.mesh_axes)
    predicted = strategies.predict_comm(key, model.TINY, 32, n, mesh_shape)
    assert comms.sent_by_axis(measured) == pytest.approx(comms.sent_by_axis(predicted))
    assert sorted(c.kind for c in measured if c.group_size > 1) == sorted(
        t.kind for t in predicted if t.group_size > 1
    )


def test_predictions_of_the_lab_figures():
    from course_lib.config import PROFILES

    cpu, gpu = PROFILES["cpu"].model, PROFILES["gpu"].model
    pairs = strategies.predict_comm("shard_map_pairs", cpu, 64, 8)
    assert [t.size_bytes for t in pairs if t.axis == "model"] == [
        1_048_576,
        8_192,
        262_144,
    ]  # conv2 out is 1 MiB
    gpu_pairs = comms.sent_by_axis(strategies.predict_comm("shard_map_pairs", gpu, 512, 8))
    assert gpu_pairs["model"] == 167_837_696  # 160.06 MiB per device per step
    b = strategies.predict_comm("pmap", gpu, 512, 8)
    assert b[0].size_bytes == 8_619_564  # 8.6 MB of gradients (and the loss)
    gather = comms.sent_by_axis(strategies.predict_comm("shard_map", gpu, 512, 8))
    assert gather["model"] == 109_057_024  # 35 % below the pairs layout
    assert strategies.predict_comm("jit", cpu, 64, 1) == []
    with pytest.raises(ValueError, match="no communication model"):
        strategies.predict_comm("fsdp_jit", cpu, 64, 8)


def test_bfloat16_collectives_move_as_float32_on_cpu(report):
    # XLA:CPU computes bf16 collectives in f32: the program asks for bf16 activations, the CPU moves 4 bytes
    s, compiled = _compiled("shard_map", report.devices, precision="bfloat16")
    measured = comms.collectives(compiled.as_text(), s.mesh_axes)
    assert {c.dtypes for c in measured} == {("f32",)}
    cpu = strategies.predict_comm(
        "shard_map", model.TINY, 32, 8, precision="bfloat16", platform="cpu"
    )
    gpu = strategies.predict_comm(
        "shard_map", model.TINY, 32, 8, precision="bfloat16", platform="gpu"
    )
    assert comms.total_sent(measured) == pytest.approx(comms.total_sent(cpu))
    assert comms.sent_by_axis(gpu)["model"] == pytest.approx(comms.sent_by_axis(cpu)["model"] / 2)
    assert (
        comms.sent_by_axis(gpu)["data"] == comms.sent_by_axis(cpu)["data"]
    )  # gradients stay float32


def test_a_permute_that_stops_at_the_edge_sends_less_per_device():
    shift = "source_target_pairs={{0,1},{1,2},{2,3}}"  # device 3 sends nothing
    (c,) = comms.collectives(
        hlo(f"%cp = f32[8,4]{{1,0}} collective-permute(%z), {shift}"), {"data": 4}
    )
    assert c.sent_bytes == pytest.approx(3 / 4 * 128)
    ring = "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
    (r,) = comms.collectives(
        hlo(f"%cp = f32[8,4]{{1,0}} collective-permute(%z), {ring}"), {"data": 4}
    )
    assert r.sent_bytes == 128  # a cycle: every device sends its block once
    (n,) = comms.collectives(hlo(f"%cp = f32[8,4]{{1,0}} collective-permute(%z), {shift}"))
    assert n.sent_bytes == pytest.approx(3 / 4 * 128)  # no mesh: the devices the pairs name
    assert (
        comms.permute_bytes(100, [(0, 0), (1, 0)], 2) == 50
    )  # a device "sending" to itself sends nothing


def test_what_the_partitioner_chose_for_fsdp_as_sharded_jit(report):
    # E' on XLA:CPU: every sharded parameter all-gathered, the whole gradients all-reduced (what B sends;
    # no reduce-scatter on CPU), some kernels gathered again for the backward pass, activations resharded
    s, compiled = _compiled("fsdp_jit", report.devices)
    measured = comms.collectives(compiled.as_text(), s.mesh_axes)
    labels = comms.what_moves(measured, comms.param_shapes(model.TINY))
    sent = {}
    for c, what in zip(measured, labels, strict=True):
        sent[what] = sent.get(what, 0.0) + c.sent_bytes
    fsdp = strategies.predict_comm("fsdp", model.TINY, 32, 8)
    b = strategies.predict_comm("pmap", model.TINY, 32, 8)
    gathers = sum(t.sent_bytes for t in fsdp if t.kind == "all-gather")
    assert sent[comms.PARAMETERS] == pytest.approx(gathers)
    assert sent[comms.GRADIENTS] == pytest.approx(comms.total_sent(b))
    assert "reduce-scatter" not in {c.kind for c in measured}
    assert comms.total_sent(measured) > comms.total_sent(fsdp)


def test_bfloat16_gradients_of_sharded_jit_move_in_two_bytes_on_gpus():
    cpu = strategies.predict_comm("sharded_jit", model.TINY, 32, 8, precision="bfloat16")
    gpu = strategies.predict_comm(
        "sharded_jit", model.TINY, 32, 8, precision="bfloat16", platform="gpu"
    )
    n_params = sum(
        math.prod(s) for v in comms.param_shapes(model.TINY).values() for s in v.values()
    )
    assert cpu[0].size_bytes == 4 * n_params + 4  # XLA:CPU sums them in float32
    assert (
        gpu[0].size_bytes == 2 * n_params + 4
    )  # XLA:GPU keeps the partitioner's bfloat16; f32 loss
    for key in ("pmap", "fsdp"):  # these reduce float32 gradients on every platform
        assert comms.total_sent(
            strategies.predict_comm(key, model.TINY, 32, 8, precision="bfloat16", platform="gpu")
        ) == pytest.approx(comms.total_sent(strategies.predict_comm(key, model.TINY, 32, 8)))


def test_same_bytes_is_exact_for_whole_counts_and_tolerates_the_last_bit_of_fractions():
    # 6 devices: the ring all-reduce's 2(n-1)/n = 5/3 makes fractions, added in another order by the program
    assert comms.same_bytes(12806.666666666666, 12806.666666666668)
    assert not comms.same_bytes(12806.666666666666, 12806.67)
    # whole counts must agree exactly: one byte off is a different program
    assert comms.same_bytes(4096, 4096.0) and not comms.same_bytes(4096.0, 4097.0)
    assert not comms.same_bytes(1e15, 1e15 + 1)
    assert comms.same_by_axis({"data": 4.0, "model": 1 / 3}, {"model": 1 / 3 + 1e-17, "data": 4})
    assert not comms.same_by_axis({"data": 4.0}, {"data": 4.0, "model": 8.0})
