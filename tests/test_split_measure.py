"""The readers of lesson 10's programs (course_lib.split_measure) on small programs whose answers are known:
a scan's primitive count, a vjp's residual bytes, a pytree difference, a step's row and table, the
all-reduces of a loop, attention temporaries by ring size."""

import jax
import jax.numpy as jnp
import pytest
from jax import P, lax

from course_lib import split_measure as M
from course_lib import splits
from course_lib.meshes import CONTEXT, DATA, mesh_of

L = 3


def _loop_step(mesh):
    """A step with one psum of a [4, 8] float32 inside a scan of L trips, and one after it."""

    def step(x):
        def body(h, _):
            return h + lax.psum(h * 2.0, DATA), None

        h, _ = lax.scan(body, x, None, length=L)
        return lax.psum(h.sum(), DATA)

    return jax.shard_map(step, mesh=mesh, in_specs=P(DATA), out_specs=P())


def test_count_primitive_weights_scan_bodies(report):
    mesh = mesh_of({DATA: 4}, list(report.devices[:4]), axis_type="auto")
    jaxpr = jax.make_jaxpr(_loop_step(mesh))(jnp.ones((16, 8)))
    assert M.count_primitive(jaxpr, "psum_invariant") == L + 1  # L in the scan's body, 1 after it
    assert M.count_primitive(jaxpr, "scan") == 1


def test_residual_bytes_and_tree_diff():
    x = jnp.arange(6.0, dtype=jnp.float32)
    _, vjp_fn = jax.vjp(jnp.sin, x)
    assert M.residual_bytes(vjp_fn) == x.nbytes  # cos(x), kept for the backward pass
    scaled = lambda diff, ref: diff
    assert M.tree_diff({"a": x}, {"a": x + 0.5}, scaled) == 0.5
    with pytest.raises(ValueError, match="the trees differ"):
        M.tree_diff({"a": x}, {"b": x}, scaled)


def test_step_row_table_and_loop_all_reduces(report):
    mesh = mesh_of({DATA: 4}, list(report.devices[:4]), axis_type="auto")
    c = jax.jit(_loop_step(mesh)).lower(jnp.ones((16, 8))).compile()
    row = M.step_row(c, mesh, trips=L)
    assert set(row) == {"args", "temp", "out", "sent", "flops"}
    assert row["args"] == 16 * 8 * 4 // 4  # one device's rows
    assert row["sent"]["all-reduce"]["count"] == L + 1
    table = M.step_table({"loop": row})
    assert len(table.splitlines()) == 3 and table.splitlines()[1].startswith("loop")
    ar = M.dp_loop_all_reduces(c.as_text(), mesh, trips=L)
    assert len(ar["in_loop"]) == 1 and ar["outside"] == 1
    assert set(ar["trips"].values()) == {L}
    assert ar["loop_bytes"] == L * 4 * 8 * 4  # a [4, 8] float32 per trip
    assert ar["loop_sent"] == pytest.approx(
        L * 2 * 3 / 4 * 4 * 8 * 4
    )  # the ring model's all-reduce


def test_attention_temporaries(report):
    fns = {"ring": splits.ring_attention, "ulysses": splits.ulysses_attention}
    temps = M.attention_temporaries(
        fns, (2, 4), report.devices, (1, 4, 2, 4), jnp.float32, jax.random.key(0), CONTEXT,
        heads_split={"ulysses"},
    )  # fmt: skip
    assert set(temps) == {("ring", 2), ("ring", 4), ("ulysses", 2)}  # 2 heads: no Ulysses on 4
    assert all(isinstance(v, int) and v >= 0 for v in temps.values())
    with pytest.raises(ValueError, match="a ring of 16 devices needs 16 devices"):
        M.attention_temporaries(
            fns, (16,), report.devices, (1, 4, 2, 4), jnp.float32, jax.random.key(0), CONTEXT
        )


def test_attention_temporaries_at_the_lessons_sizes(report):
    """Section 3's claims on XLA:CPU, at its block (4 sequences, 8 positions, 8 heads of 4) on rings of 3, 4
    and 8: the fori_loop ring stays flat, the unrolled ring grows by more than a block per device added,
    Ulysses grows; temporaries_table lays them out in blocks."""
    import functools

    import numpy as np

    fns = {
        "ring": splits.ring_attention,
        "ring, unrolled": functools.partial(splits.ring_attention, unroll=True),
        "ulysses": splits.ulysses_attention,
    }
    rings, shape = [3, 4, 8], (4, 8, 8, 4)
    temps = M.attention_temporaries(
        fns, rings, report.devices, shape, jnp.float32, jax.random.key(30), CONTEXT,
        compiler_options={"xla_backend_optimization_level": 0}, heads_split={"ulysses"},
    )  # fmt: skip
    table = M.temporaries_table(temps, int(np.prod(shape)) * 4)
    assert list(table.columns) == rings and np.isnan(table.loc["ulysses", 3])  # 8 heads over 3: no
    ring = table.loc["ring", rings]
    assert ring.max() < 1.1 * ring.min()
    assert (np.diff(table.loc["ring, unrolled", rings]) > np.diff(rings)).all()
    assert table.loc["ulysses", 4] < table.loc["ulysses", 8]
    with pytest.raises(ValueError, match="must be positive"):
        M.temporaries_table(temps, 0)
