"""course_lib.programs: the equations and collectives of a jaxpr, the collectives of a compiled program
with their mesh axes and sizes, compile counting (8 simulated CPU devices, from conftest.py)."""

import logging

import jax
import jax.numpy as jnp
import pytest
from jax import P, lax
from jax.sharding import AxisType, NamedSharding

from course_lib import programs
from course_lib.meshes import DATA, MODEL, data_model_mesh


@pytest.fixture(scope="module")
def mesh(report):
    return data_model_mesh(report.devices, (4, 2), axis_type="explicit")


@pytest.mark.parametrize(
    "line, mesh_shape, axes",
    [
        (
            "%a = f32[4] all-reduce(%x), replica_groups=[4,2]<=[8], to_apply=%add",
            {DATA: 4, MODEL: 2},
            (MODEL,),
        ),
        (
            "%a = f32[4] all-reduce(%x), replica_groups=[2,4]<=[4,2]T(1,0)",
            {DATA: 4, MODEL: 2},
            (DATA,),
        ),
        (
            "%a = f32[4] all-gather(%x), replica_groups={{0,2,4,6},{1,3,5,7}}",
            {DATA: 4, MODEL: 2},
            (DATA,),
        ),
        (
            "%a = f32[] all-reduce(%x), replica_groups=mesh['data'=4,'model'=2] {'data'}",
            {DATA: 4, MODEL: 2},
            (DATA,),
        ),
        (
            "%a = f32[] all-reduce-start(%x), replica_groups=mesh['axis_0'=2] {'axis_0'}",
            {DATA: 1, MODEL: 2},
            (MODEL,),
        ),
        (
            "%a = (f32[2], f32[]) all-reduce(%x, %y), replica_groups={}",
            {DATA: 2, MODEL: 1},
            (DATA,),
        ),
        (
            "%p = f32[2] collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
            {DATA: 4},
            (DATA,),
        ),
        (
            "%a = f32[4] all-reduce(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}",
            {DATA: 4, MODEL: 2},
            (MODEL,),
        ),
        (
            "%a = f32[4] all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}",
            {DATA: 4, MODEL: 2},
            (DATA, MODEL),
        ),
        ("%a = f32[4] all-reduce(%x), replica_groups={{0},{1},{2},{3}}", {DATA: 4}, ()),
    ],
)
def test_every_group_syntax_names_the_mesh_axes(line, mesh_shape, axes):
    op = next(o for o in programs.HLO_COLLECTIVES if f" {o}(" in line or f" {o}-start(" in line)
    assert programs.collectives(f"  {line}\n  %b = f32[4] add(%a, %a)", mesh_shape) == [(op, axes)]


def _compiled(fn, mesh, *arrays_and_specs):
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in arrays_and_specs]
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("shape", [(4, 2), (2, 4), (1, 2), (2, 1), (1, 1)])
def test_collectives_of_real_programs(report, shape):
    mesh = data_model_mesh(report.devices[: shape[0] * shape[1]], shape, axis_type="explicit")
    sizes = dict(mesh.shape)
    x, w = jnp.ones((16, 16)), jnp.ones((16, 4))
    contract = _compiled(
        lambda a, b: jnp.matmul(a, b, out_sharding=P(DATA, None)),
        mesh,
        (x, P(DATA, MODEL)),
        (w, P(MODEL, None)),
    )
    col_sum = _compiled(lambda a: a.sum(axis=0), mesh, (x, P(DATA, None)))
    rowwise = _compiled(lambda a: 2 * a, mesh, (x, P(DATA, MODEL)))
    assert programs.collectives(contract, sizes) == (
        [("all-reduce", (MODEL,))] if sizes[MODEL] > 1 else []
    )
    assert programs.collectives(col_sum, sizes) == (
        [("all-reduce", (DATA,))] if sizes[DATA] > 1 else []
    )
    assert programs.collectives(rowwise, sizes) == []


def test_collectives_with_their_axes_sizes_and_ring_bytes(mesh):
    def body(x, w):  # x: [16/4, 6], w: [6, 4/2]
        h = lax.psum(x @ w, MODEL)  # [4, 2], summed over model: an all-reduce
        gathered = lax.all_gather(h, DATA, tiled=True, to="invarying")
        return gathered, lax.psum_scatter(x, DATA, tiled=True)

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(DATA, None), P(None, MODEL)),
            out_specs=(P(), P(DATA, None)),
        )
    )
    args = (
        jax.device_put(jnp.ones((16, 6)), NamedSharding(mesh, P(DATA, None))),
        jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P(None, MODEL))),
    )
    ops = programs.collective_ops(f.lower(*args).compile().as_text(), mesh)
    got = sorted((op.op, op.axes, op.group_size, op.nbytes, op.bytes_sent) for op in ops)
    assert got == [
        ("all-gather", (DATA,), 4, 16 * 2 * 4, 3 / 4 * 16 * 2 * 4),
        ("all-reduce", (MODEL,), 2, 4 * 2 * 4, 2 * 1 / 2 * 4 * 2 * 4),
        (
            "reduce-scatter",
            (DATA,),
            4,
            1 * 6 * 4,
            3 * 1 * 6 * 4,
        ),  # (n-1)/n of the 4x larger operand
    ]
    assert all(op.name and op.name in op.line for op in ops)


def test_combined_all_reduce_is_one_tuple(mesh):
    def grads(w, b, x):
        return jax.grad(lambda w, b: lax.pmean(jnp.mean((x @ w + b) ** 2), DATA), argnums=(0, 1))(
            w, b
        )

    f = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P(), P(DATA)), out_specs=(P(), P())))
    x = jax.device_put(jnp.arange(48.0).reshape(16, 3), NamedSharding(mesh, P(DATA)))
    (op,) = programs.collective_ops(
        f.lower(jnp.ones((3, 2)), jnp.ones(2), x).compile().as_text(), mesh
    )
    assert op.op == "all-reduce" and op.axes == (DATA,) and op.shape.startswith("(")
    assert op.nbytes == (3 * 2 + 2) * 4


def test_device_numbers_without_a_mesh_and_async_pairs(mesh):
    line = (
        "%all-reduce.1 = f32[8,16]{1,0} all-reduce(f32[8,16]{1,0} %x), channel_id=1, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add"
    )
    (op,) = programs.collective_ops(line, mesh)
    assert (op.op, op.axes, op.nbytes, op.name) == ("all-reduce", (MODEL,), 512, "all-reduce.1")
    assert programs.collective_ops(line)[0].axes is None  # device numbers, no mesh to name them
    start = (
        "%ag = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %x), "
        "replica_groups={{0,1,2,3}}, dimensions={0}"
    )
    done = "%ag.done = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %ag)"
    (op,) = programs.collective_ops(start + "\n" + done, {DATA: 4})
    assert (op.op, op.shape, op.nbytes) == ("all-gather", "f32[16]{0}", 64)  # the -done's result


def test_jaxpr_equations_walks_nested_jaxprs_and_counts_scan_lengths():
    def f(x):
        y = jax.jit(jnp.sin)(x)
        return lax.fori_loop(0, 5, lambda i, h: jnp.cos(h), y)

    eqns = [(e.primitive.name, t) for e, t in programs.jaxpr_equations(jax.make_jaxpr(f)(1.0))]
    assert ("sin", 1) in eqns and ("cos", 5) in eqns
    assert ("jit", 1) in eqns and ("scan", 1) in eqns


def test_jaxpr_collectives_finds_loops_and_operands():
    def body(v):
        total, _ = lax.scan(lambda c, x: (c + lax.pmean(x, DATA), None), v[0], v)
        return lax.psum((total, 2 * total), DATA)

    found = programs.jaxpr_collectives(
        jax.make_jaxpr(jax.pmap(body, axis_name=DATA))(jnp.ones((8, 3, 2)))
    )
    assert [(p, loop) for p, _, loop in found] == [("psum", True)] + [("psum", False)] * (
        len(found) - 1
    )
    assert sum(ops for _, ops, loop in found if not loop) == 2  # the tuple's two arrays


def test_compile_log_counts_one_program_per_placement_and_restores_the_logger(report):
    mesh = jax.make_mesh((8,), (DATA,), axis_types=(AxisType.Auto,), devices=report.devices)
    logger = logging.getLogger("jax")
    propagate = logger.propagate

    def plus_one(a):
        return a + 1

    f, v = jax.jit(plus_one), jnp.arange(16.0)
    with programs.CompileLog() as log:
        for arg in (
            v,
            jax.device_put(v, NamedSharding(mesh, P(DATA))),
            jax.device_put(v, report.devices[3]),
            v + 0,
        ):
            f(arg)
    assert (
        log.count("plus_one") == 3
    )  # unplaced, split, committed to a device; v + 0 is a cache hit
    assert logger.propagate == propagate and log not in logger.handlers
    f(v * 3)
    assert log.count("plus_one") == 3  # nothing is collected after the block


def test_hlo_kernels_counts_what_the_entry_computation_launches():
    def scaled_norm(x, scale):
        return scale * jnp.sqrt(jnp.sum(x**2))

    hlo = jax.jit(scaled_norm).lower(jnp.arange(4.0), 1.0).compile().as_text()
    assert programs.hlo_kernels(hlo) == {"fusion": 1}  # five operations, one fused kernel (XLA:CPU)
    assert not programs.hlo_memory_moves(hlo)  # XLA:CPU has one memory space

    def two_matmuls(a, b):
        return (a @ b) @ b.T

    ops = programs.hlo_kernels(
        jax.jit(two_matmuls).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
    )
    assert sum(ops.values()) >= 2 and "parameter" not in ops
    with pytest.raises(ValueError, match="no ENTRY computation"):
        programs.hlo_kernels("not HLO")


# XLA:TPU's entry computation of lesson 02's scaled_norm (TPU v5e, JAX 0.10.2; reference run's log, trimmed)
_TPU_SCALED_NORM = """
ENTRY %main.2 (x.1: f32[4], scale.1: f32[]) -> f32[] {
  %scale.1 = f32[]{:T(128)} parameter(1), metadata={op_name="scale"}
  %x.1 = f32[4]{0:T(128)} parameter(0), metadata={op_name="x"}
  %copy-start = (f32[4]{0:T(128)S(1)}, f32[4]{0:T(128)}, u32[]{:S(2)}) copy-start(%x.1)
  %copy = f32[]{:T(128)S(6)} copy(%scale.1), backend_config={"aliasing_operands":{"lists":[]}}
  %copy-done = f32[4]{0:T(128)S(1)} copy-done(%copy-start)
  %multiply_reduce_fusion = f32[]{:T(128)} fusion(%copy-done), kind=kLoop, calls=%fused_computation
  %sqrt.1 = f32[]{:T(128)S(6)} sqrt(%multiply_reduce_fusion), metadata={op_name="jit(scaled_norm)/sqrt"}
  ROOT %mul.1 = f32[]{:T(128)} multiply(%copy, %sqrt.1), metadata={op_name="jit(scaled_norm)/mul"}
}
"""


def test_memory_moves_are_not_kernels():
    assert programs.hlo_kernels(_TPU_SCALED_NORM) == {"fusion": 1, "sqrt": 1, "multiply": 1}
    moves = programs.hlo_memory_moves(_TPU_SCALED_NORM)
    assert moves == {"copy-start": 1, "copy-done": 1, "copy": 1}
    layout_copy = (
        "\nENTRY %m (a: f32[2,3]) -> f32[3,2] {\n  ROOT %copy = f32[2,3]{0,1} copy(%a)\n}\n"
    )
    assert programs.hlo_kernels(layout_copy) == {"copy": 1}  # one memory space: a kernel
    assert not programs.hlo_memory_moves(layout_copy)
    with pytest.raises(ValueError, match="no ENTRY computation"):
        programs.hlo_memory_moves("not HLO")


def test_cpu_compiled_is_xla_cpu_on_any_host():
    from course_lib.kernels import compiled_on, cpu_compiled

    compiled = cpu_compiled(lambda x: jnp.sum(x**2), jnp.arange(4.0))
    assert "cpu" in {d.platform for d in compiled.input_shardings[0][0].device_set}
    assert compiled.memory_analysis().temp_size_in_bytes >= 0
    assert not programs.hlo_memory_moves(compiled.as_text())  # XLA:CPU: one memory space
    device = jax.devices()[-1]
    on_device = compiled_on(device, lambda x: 2 * x, jnp.arange(4.0))
    assert on_device.input_shardings[0][0].device_set == {device}


def test_compile_log_counts_eager_operations_too():
    f = jax.jit(lambda v: 2 * v)
    # a shape no other test uses: an eager add of a shape another test already added in this process is
    # cached, and compiles nothing here
    x4 = jnp.arange(3 * 7 * 11.0).reshape(3, 7, 11)  # made before the block
    f(x4)
    with programs.CompileLog() as log:
        f(x4)  # cached: nothing compiled
        f(x4 + 1)  # the eager add compiles (a new program), the call does not
    assert log.compiled == ["jit(add)"]


def test_computation_of_each_collective_and_while_bodies():
    text = (
        "ENTRY %main (p: f32[8]) -> f32[8] {\n"
        "  %ar = f32[8]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add\n"
        "  %w = f32[8] while(%ar), condition=%cond, body=%body\n}\n"
        "%body (q: f32[8]) -> f32[8] {\n"
        "  %ar2 = f32[8]{0} all-reduce(%q), replica_groups=[1,8]<=[8], to_apply=%add\n}\n"
    )
    outer, inner = programs.collective_ops(text, {DATA: 8})
    assert (outer.computation, inner.computation) == ("main", "body")
    assert programs.while_bodies(text) == {"body"}
    assert programs.collective_ops("%a = f32[4] all-reduce(%x)")[0].computation == ""


def test_sub_axis_groups_are_refused_not_misread():
    line = "%ar = f32[8]{0} all-reduce(%x), replica_groups=mesh['data'=8] {'data':(1)2}"
    with pytest.raises(ValueError, match="sub-axes"):
        programs.collective_ops(line, {DATA: 8})


def test_arrays_of_an_hlo_type():
    assert programs.arrays("(f32[2]{0}, bf16[3,4]{1,0}, f32[])") == (
        ("f32", (2,)),
        ("bf16", (3, 4)),
        ("f32", ()),
    )


def test_runs_multiply_the_trip_counts_of_nested_loops(report):
    """A psum in a scan of 5 inside a scan of 3 runs 15 times, forward and backward, read from the
    ``known_trip_count`` XLA writes on each compiled loop."""
    mesh = jax.make_mesh((2,), (DATA,), devices=report.devices[:2], axis_types=(AxisType.Auto,))

    def loss(x, ws):
        def step(h, w):
            return lax.psum(jnp.tanh(h @ w), DATA) @ jnp.ones((2, 8)), None

        return lax.scan(lambda h, w3: (lax.scan(step, h, w3)[0], None), x, ws)[0].sum()

    f = jax.shard_map(
        jax.grad(loss, argnums=1),
        mesh=mesh,
        in_specs=(P(), P(None, None, None, DATA)),
        out_specs=P(None, None, None, DATA),
    )
    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((3, 5, 8, 4))).compile().as_text()
    ops = programs.collective_ops(text, mesh)
    assert [o.runs for o in ops] == [15, 15]


def test_an_unrolled_body_counts_each_copy_at_its_trips():
    """A loop of 4 unrolled by 2 (XLA:GPU's default for loops with collectives): two copies, 2 trips."""
    loop = '"known_trip_count":{"n":"2"}'
    text = (
        "%body (q: f32[8]) -> f32[8] {\n"
        "  %a = f32[8]{0} all-reduce(%q), replica_groups=[1,8]<=[8], to_apply=%add\n"
        "  %b = f32[8]{0} all-reduce(%a), replica_groups=[1,8]<=[8], to_apply=%add\n}\n"
        "%nobound (q: f32[8]) -> f32[8] {\n"
        "  %c = f32[8]{0} all-reduce(%q), replica_groups=[1,8]<=[8], to_apply=%add\n}\n"
        "ENTRY %main (p: f32[8]) -> f32[8] {\n"
        f"  %w = f32[8] while(%p), condition=%cond, body=%body, backend_config={{{loop}}}\n"
        "  %v = f32[8] while(%w), condition=%cond, body=%nobound\n}\n"
    )
    assert [o.runs for o in programs.collective_ops(text, {DATA: 8})] == [2, 2, None]
    assert programs.computation_runs(text)["main"] == 1


def test_traced_shapes_reads_layer_norm_inputs():
    """XLA:TPU's committed 8-chip programs (cpu sizes: B 4, S 16, D 32): TP's LayerNorms see the whole
    sequence, SP's a device's eighth of it; a name that is not there gives nothing."""
    from course_lib import aot

    sp, tp = (aot.hlo_text(f"lesson10.{k}_forward") for k in ("sp", "tp"))
    assert programs.traced_shapes(sp, "multiply", "square") == [(4, 2, 32)] * 3
    assert programs.traced_shapes(tp, "multiply", "square") == [(4, 16, 32)] * 3
    assert programs.traced_shapes(sp, "multiply", "no_such_op") == []
    assert programs.traced_shapes("", "add", "square") == []


def test_an_xla_tpu_collective_fusion_counts_once_and_asynchronous():
    # XLA:TPU writes an asynchronous collective fusion's all-gather in every fusion of its chain (start,
    # continuations, done), each copy tagged with one chain_id: one collective, issued asynchronously
    from course_lib import aot

    text = aot.hlo_text("lab08.fsdp.float32")
    copies = [line for line in text.splitlines() if "chain_id=" in line and "all-gather(" in line]
    chains = {line.split('chain_id="')[1].split('"')[0] for line in copies}
    assert len(copies) == 12 and chains == {"0", "1", "2"}
    gathers = [o for o in programs.collective_ops(text, {"data": 8}) if o.op == "all-gather"]
    assert [o.asynchronous for o in gathers].count(True) == len(chains)
    assert len(gathers) == len(chains) + 2  # and two synchronous gathers outside any chain
    # one copy's bytes each: the three kernels [3,3,32,64], [3,3,64,64], [1024,128] in bfloat16
    assert sorted(o.nbytes for o in gathers if o.asynchronous) == [36_864, 73_728, 262_144]
