"""course_lib.pipeline_memory: the slots of the one-operation tables per stage, the bytes a split B saves,
and the compiled step's temporaries (notebook 11, section 6.4, "Memory held")."""

import jax
import jax.numpy as jnp
import pytest

from course_lib import op_schedules as O
from course_lib import pipeline as PL
from course_lib import pipeline_measure as PM
from course_lib import pipeline_memory as MEM
from course_lib.meshes import STAGE, mesh_of


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_slots_per_stage_of_1f1b_and_zb_h1(p, m):
    for name in ("1f1b", "zb_h1"):
        got = MEM.slots(O.make(name, p, m), split_stage=True)
        # p - s in flight on stage s; one more input slot on s >= 1: an input that arrived waits for its F
        assert got.inputs == [p] + [p - s + 1 for s in range(1, p)], (name, got)
        assert got.in_flight == O.predicted_in_flight(name, p, m), (name, got)
        # ZB-H1's W runs s B's late on stage s: s + 1 saved values; a fused B saves nothing
        assert got.saved == ([s + 1 for s in range(p)] if name == "zb_h1" else [0] * p), (name, got)
        assert got.step[0] == p and got.step[2] == (p if name == "zb_h1" else 0)
    # without the split stage, ZB-H1's W recomputes: an input and a cotangent wait for it instead
    plain = MEM.slots(O.zb_h1(p, m), split_stage=False)
    assert plain.step == (p, p, 0) and plain.saved == [0] * p


def test_saved_bytes_are_two_activations_per_layer():
    stage = PM.residual_stage(split=True)
    for dtype, layers in ((jnp.float32, 4), (jnp.float16, 2)):
        x = jax.ShapeDtypeStruct((8, 16), dtype)
        chunk = {"w": jax.ShapeDtypeStruct((layers, 16, 16), dtype)}
        assert MEM.saved_bytes(stage, chunk, x) == 2 * layers * 8 * 16 * jnp.dtype(dtype).itemsize


def test_saved_bytes_refuses_a_stage_that_saves_nothing():
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with pytest.raises(ValueError, match="is not a split stage.*residual_stage\\(split=True\\)"):
        MEM.saved_bytes(PM.residual_stage(), {"w": jnp.zeros((2, 16, 16))}, x)


def test_beside_saved_slots_and_its_refusal():
    assert MEM.beside_saved_slots(1000, 300, 2, 200) == {"extra": 700, "buffer": 600, "beyond": 100}
    with pytest.raises(ValueError, match="slot_bytes=-1"):
        MEM.beside_saved_slots(1, 1, 1, -1)


def test_zb_h1_temporaries_grow_by_no_stash(report):
    # XLA:CPU: from m to 2m the slots stay; the temporaries grow by less than a stash of m inputs would add
    p, m = 2, 4
    mesh = mesh_of({STAGE: p}, report.devices[:p], axis_type="auto")
    params = PL.chunked(PM.init_residual(jax.random.key(0), 2 * p, 16), 1)
    xs = jax.random.normal(jax.random.key(1), (m, 8, 16))
    got = MEM.temp_growth(mesh, STAGE, O.zb_h1(p, m), PM.residual_stage(split=True), params, xs)
    assert got["slots"][0] == got["slots"][1] == (p, 1, p)
    assert got["cotangents"] == m * 8 * 16 * 4
    assert got["grown"] == got["temp"][1] - got["temp"][0]
    assert (
        0 <= got["grown"] < 2 * got["cotangents"]
    )  # a stash would add m inputs beyond the cotangents
    with pytest.raises(ValueError, match="xs holds 3 micro-batches, the table 4: pass xs\\[:4\\]"):
        MEM.temp_growth(mesh, STAGE, O.zb_h1(p, m), PM.residual_stage(split=True), params, xs[:3])
