"""The transformer's splits (course_lib.splits) against one device in float64, their collectives and bytes
read from the compiled program; the pictures of course_lib.split_diagrams drawn from small cases.
(``splits.zero3_blocks`` is judged in tests/test_checks_lesson10.py, as the ZeRO-3 exercise's reference.)"""

import functools

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import split_diagrams as SD
from course_lib import splits as SP
from course_lib import transformer as T
from course_lib.meshes import CONTEXT, MODEL, mesh_of
from course_lib.programs import collective_ops, jaxpr_equations, while_bodies

matplotlib.use("Agg")
ONCE = {"xla_backend_optimization_level": 0}
CFG = T.TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=4, d_ff=32, n_layers=2)


@functools.cache
def _init(dtype=jnp.float32):
    """The model's parameters (biases made non-zero), initialised as one compiled program."""

    def init(key):
        params = T.init_model(key, CFG)[1]
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        return tree.unflatten(
            [a + 0.05 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)]
        )

    return jax.jit(init, compiler_options=ONCE)(jax.random.key(0))


def _params():
    return jax.tree.map(lambda a: np.asarray(a, np.float64), _init())


def _mesh(report, axis, n):
    return mesh_of({axis: n}, report.devices[:n], axis_type="auto")


def test_tp_and_sp_equal_one_device_and_send_the_same_bytes(report):
    n = 4
    mesh = _mesh(report, MODEL, n)
    with jax.enable_x64(True):
        params = _params()
        tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab)
        want = jax.jit(T.forward, compiler_options=ONCE)(params, tokens)
        specs = {**jax.tree.map(lambda _: P(), params), "blocks": SP.tp_specs(MODEL)}

        def tp(prm, tok):
            return T.forward(prm, tok, block_fn=lambda x, p: SP.tp_block(x, p, MODEL))

        def sp(prm, tok):
            s = tok.shape[1] // n
            x = lax.dynamic_slice_in_dim(T.embed(prm, tok), lax.axis_index(MODEL) * s, s, axis=1)
            x, _ = lax.scan(lambda h, p: (SP.sp_block(h, p, MODEL), None), x, prm["blocks"])
            return T.head(prm, x)

        sent = {}
        for name, fn, out in (("tp", tp, P()), ("sp", sp, P(None, MODEL))):
            f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P()), out_specs=out)
            c = jax.jit(f, compiler_options=ONCE).lower(params, tokens).compile()
            assert float(jnp.abs(c(params, tokens) - want).max()) < 1e-10
            sent[name] = SP.loop_sent(c.as_text(), mesh)
    assert set(sent["tp"]) == {"all-reduce"} and set(sent["sp"]) == {"all-gather", "reduce-scatter"}
    act = 2 * CFG.seq_len * CFG.d_model * 8
    total = {k: sum(r["sent"] for r in v.values()) for k, v in sent.items()}
    assert (
        total["tp"]
        == total["sp"]
        == SP.predict_tp_sp("tp", 2, CFG.seq_len, CFG.d_model, n, 8)["sent"] * CFG.n_layers
    )
    assert act > 0


def test_tp_block_backward_is_megatrons_f(report):
    """One backward psum per sub-layer (Megatron's f), not one per use of the input; the gradient equals
    one device's in float64."""
    n = 4
    mesh = _mesh(report, MODEL, n)
    with jax.enable_x64(True):
        params = _params()
        tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab)
        specs = {**jax.tree.map(lambda _: P(), params), "blocks": SP.tp_specs(MODEL)}
        fwd = jax.shard_map(
            lambda prm, tok: T.forward(prm, tok, block_fn=lambda x, p: SP.tp_block(x, p, MODEL)),
            mesh=mesh,
            in_specs=(specs, P()),
            out_specs=P(),
        )
        grad = jax.grad(lambda prm: jnp.sum(fwd(prm, tokens) ** 2))
        psums = sum(
            t
            for e, t in jaxpr_equations(jax.make_jaxpr(grad)(params))
            if e.primitive.name == "psum_invariant"
        )
        want = jax.grad(lambda prm: jnp.sum(T.forward(prm, tokens) ** 2))(params)
        got = jax.jit(grad, compiler_options=ONCE)(params)
        worst = max(
            float(jnp.abs(a - b).max() / jnp.abs(b).max())
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        )
    assert psums == 4 * CFG.n_layers  # 2 forward (g) + 2 backward (f) per layer
    assert worst < 1e-10


UNROLLED = functools.partial(SP.ring_attention, unroll=True)


@pytest.mark.parametrize("fn", [SP.ring_attention, UNROLLED, SP.ulysses_attention])
def test_context_parallel_attention_equals_causal_attention(report, fn):
    n = 4
    mesh = _mesh(report, CONTEXT, n)
    with jax.enable_x64(True):
        q, k, v = (
            jax.random.normal(jax.random.key(i), (2, 16, 4, 8), jnp.float64) for i in range(3)
        )
        spec = P(None, CONTEXT)
        f = jax.shard_map(
            lambda a, b, c: fn(a, b, c, CONTEXT), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
        )
        c = jax.jit(f, compiler_options=ONCE).lower(q, k, v).compile()
        assert float(jnp.abs(c(q, k, v) - T.causal_attention(q, k, v)).max()) < 1e-10
    ops = collective_ops(c.as_text(), mesh)
    block = 2 * 4 * 4 * 8 * 8
    sent = sum(o.bytes_sent * o.runs for o in ops)  # a loop's collective at each trip
    if fn is SP.ring_attention:
        assert {o.op for o in ops} == {"collective-permute"} and sent == (n - 1) * 2 * block
        assert while_bodies(c.as_text())  # the steps in a loop
    elif fn is UNROLLED:
        # K and V, n - 1 times, written out
        assert len(ops) == 2 * (n - 1) and sent == (n - 1) * 2 * block
        assert not while_bodies(c.as_text())
    else:
        assert {o.op for o in ops} == {"all-to-all"} and sent == 4 * (n - 1) / n * block


def test_collective_matmul_equals_all_gather_then_matmul(report):
    n = 4
    mesh = _mesh(report, MODEL, n)
    x = jax.random.normal(jax.random.key(0), (8, 6))
    w = jax.random.normal(jax.random.key(1), (6, 8))
    specs = dict(mesh=mesh, in_specs=(P(MODEL), P(None, MODEL)), out_specs=P(None, MODEL))
    ring = jax.jit(jax.shard_map(lambda a, b: SP.collective_matmul(a, b, MODEL), **specs))
    np.testing.assert_allclose(ring(x, w), x @ w, rtol=1e-5, atol=1e-5)
    ops = collective_ops(ring.lower(x, w).compile().as_text(), mesh)
    assert [o.op for o in ops] == ["collective-permute"] * (n - 1)


def test_predict_tp_sp_and_its_errors():
    tp, sp = SP.predict_tp_sp("tp", 2, 8, 4, 4), SP.predict_tp_sp("sp", 2, 8, 4, 4)
    assert (
        tp["sent"] == sp["sent"] == 4 * 3 / 4 * 64 * 4
        and tp["ln_elements"] == 4 * sp["ln_elements"]
    )
    with pytest.raises(ValueError, match="'tp' or 'sp'"):
        SP.predict_tp_sp("cp", 1, 1, 1, 1)
    # XLA:TPU (its 8-chip program): bfloat16 gathers beside TP's all-reduces, the LayerNorm still split
    tpu = {k: SP.predict_tp_sp(k, 2, 8, 4, 8, compiler="XLA:TPU") for k in ("tp", "sp")}
    assert tpu["tp"] == SP.predict_tp_sp("tp", 2, 8, 4, 8)
    assert tpu["sp"]["sent"] == 1.25 * tpu["tp"]["sent"] and tpu["sp"]["ln_elements"] == 8
    with pytest.raises(ValueError, match="'XLA:CPU' or 'XLA:TPU'"):
        SP.predict_tp_sp("sp", 1, 1, 1, 1, compiler="tpu")
    with pytest.raises(ValueError, match="itemsize=8 on XLA:TPU"):
        SP.predict_tp_sp("sp", 1, 1, 1, 1, 8, compiler="XLA:TPU")


def test_pictures():
    held, seen = SD.ring_schedule(4)
    assert held[0].tolist() == [0, 1, 2, 3] and held[1].tolist() == [3, 0, 1, 2]
    assert (seen == 1).sum() == 4 and (seen == 0).sum() == 6  # diagonals; wrapped blocks masked
    for fig in (SD.heads_over_devices(8, 4), SD.ring_blocks(4), SD.zero3_timeline(2)):
        assert fig.axes
        matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="do not split"):
        SD.heads_over_devices(6, 4)


def test_megatron_fg_picture_places_one_all_reduce_each_way():
    fig = SD.megatron_fg(4, 1024)
    rects = [p for p in fig.axes[0].patches if isinstance(p, matplotlib.patches.Rectangle)]
    assert len(rects) == 14
    red = [r for r in rects if r.get_facecolor()[:3] == matplotlib.colors.to_rgb("#d62728")]
    # forward (upper row): g, after the row-parallel matmul; backward: f, before the column-parallel
    (fwd,) = [r for r in red if r.get_y() > 1]
    (bwd,) = [r for r in red if r.get_y() < 1]
    labels = [op[0] for op in SD._FG]
    assert fwd.get_x() == 1.3 * labels.index("g") and bwd.get_x() == 1.3 * labels.index("f")
    assert labels.index("f") < labels.index("x @ W1[:, cols]\ncolumn-parallel")
    assert labels.index("g") > labels.index("h @ W2[rows, :]\nrow-parallel")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum("all-reduce\n1,024 B" in t for t in texts) == 2
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="n_model=0"):
        SD.megatron_fg(0, 1)


def test_sp_picture_follows_sp_block():
    """Split between the sub-layers, whole inside them: an all-gather before each sub-layer, a
    reduce-scatter after it (splits.sp_block's collectives, two of each per block)."""
    regions = SD.sp_layout(2, 16, 8, 4)
    assert [r[1][1] for r in regions] == [4, 16, 4, 16, 4]
    assert [r[2] for r in regions] == ["all-gather", "reduce-scatter"] * 2 + [""]
    fig = SD.sp_regions(2, 16, 8, 4)
    assert "SP on 4 device(s)" in fig.axes[0].get_title(loc="left")
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="does not split"):
        SD.sp_layout(2, 10, 8, 4)


def test_ulysses_picture_swaps_the_sequence_split_for_a_head_split():
    """Before the all_to_all device r holds sequence block r of every head; after it, H/n heads of every
    block: each device holds n·H/n pieces either way (splits.ulysses_attention's tiled all_to_all)."""
    before, after = SD.ulysses_owners(8, 4)
    assert before[:, 0].tolist() == [0, 1, 2, 3] and (before == before[:, :1]).all()
    assert after[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and (after == after[:1]).all()
    assert [int((o == d).sum()) for o in (before, after) for d in range(4)] == [8] * 8
    fig = SD.ulysses_layout(8, 4)
    assert len(fig.axes[0].patches) == 2 * 4 * 8
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="do not split"):
        SD.ulysses_owners(6, 4)


def test_collective_matmul_picture_follows_the_ring():
    """Every device multiplies each block once, sends n - 1 times, and what it sends at step t is the
    block its neighbour multiplies at step t + 1 (splits.collective_matmul's ppermute to r + 1)."""
    n = 4
    held, sends = SD.collective_matmul_schedule(n)
    assert all(sorted(held[:, r].tolist()) == list(range(n)) for r in range(n))
    assert sends.sum(axis=0).tolist() == [n - 1] * n and not sends[-1].any()
    for t in range(n - 1):
        assert all(held[t + 1, (r + 1) % n] == held[t, r] for r in range(n))
    fig = SD.collective_matmul_steps(n, 8, 32, 64, 8)
    title = fig.axes[0].get_title(loc="left")
    assert "2,048 bytes" in title and "3 sends a device" in title
    matplotlib.pyplot.close(fig)
    assert SD.collective_matmul_schedule(1)[1].sum() == 0
    with pytest.raises(ValueError, match="at least one device"):
        SD.collective_matmul_schedule(0)


def test_loop_sent_reads_xla_tpus_program_with_the_layer_count():
    """XLA:TPU writes no known_trip_count: loop_sent raises, and with trips=L (the scan's length) reads the
    committed 8-chip tensor-parallel forward (v5e:2x4): two all-reduces of B·S·D float32 per layer."""
    import re

    from course_lib import aot
    from course_lib.aot_programs import LESSON10_BATCH
    from course_lib.aot_programs import LESSON10_CONFIG as C10

    text = aot.hlo_text("lesson10.tp_forward")
    with pytest.raises(ValueError, match="trips="):
        SP.loop_sent(text, {MODEL: 8})
    # the loop was not unrolled: its condition compares the counter with L
    cond = re.search(r"condition=%?([\w.\-]+)", text).group(1)
    assert re.search(rf"%{re.escape(cond)} .*?constant\((\d+)\)", text, re.S).group(1) == str(
        C10.n_layers
    )
    act = LESSON10_BATCH * C10.seq_len * C10.d_model * 4  # float32
    got = SP.loop_sent(text, {MODEL: 8}, trips=C10.n_layers)
    assert got == {
        "all-reduce": {"count": 2 * C10.n_layers, "sent": 2 * C10.n_layers * 2 * 7 / 8 * act}
    }
