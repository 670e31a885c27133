"""course_lib.diagrams: every picture shows what the run holds (values read back from the devices, shard
shapes of placed arrays, the collectives of the differentiated program), at 1, 2, 3, 4 and 8 devices; and
the figures behave (one new figure or the given Axes, no global style change, no overlapping labels)."""

import re

import jax
import jax.numpy as jnp
import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pytest
import treescope
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.patches import FancyBboxPatch

from course_lib import diagrams, meshes, model, parallel
from course_lib.meshes import DATA, MODEL

COUNTS = (1, 2, 3, 4, 8)
SHAPE = re.compile(r"\[(\d+(?:, \d+)*)\]")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    """Every label of the figure: the texts, then the titles."""
    titles = [ax.get_title(loc) for ax in fig.axes for loc in ("left", "center")]
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t for t in titles if t]


def boxes(fig) -> list[FancyBboxPatch]:
    return [p for ax in fig.axes for p in ax.patches if isinstance(p, FancyBboxPatch)]


def device_boxes(fig) -> list[FancyBboxPatch]:
    """The boxes filled with a device's colour (one device's own data)."""
    colours = [diagrams.device_color(i) for i in range(10)]
    return [
        b for b in boxes(fig) if any(mpl.colors.same_color(b.get_facecolor(), c) for c in colours)
    ]


def param_zeros(config=model.TINY):
    """Zeros shaped as the CNN's parameters (``jax.eval_shape`` of ``init_model``: no init to run)."""
    shapes = jax.eval_shape(lambda key: model.init_model(key, config)[1], jax.random.key(0))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def shapes_in(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.split(", ")) for m in SHAPE.findall(text)]


# --- collectives: the values drawn are the values the devices hold -------------------------------


def expected_after(kind, before):
    n = before.shape[0]
    return {
        "psum": np.tile(before.sum(0), (n, 1)),
        "all_gather": np.tile(before.reshape(-1), (n, 1)),
        "psum_scatter": before.sum(0)[:, None],
        "all_to_all": before.T,
        "ppermute": np.roll(before, 1, axis=0),
    }[kind]


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("kind", list(diagrams.COLLECTIVES))
def test_collective_values_and_sources_are_read_back_from_the_devices(kind, n):
    run = diagrams.run_collective(kind, n)
    assert run.device_ids == tuple(d.id for d in jax.devices()[:n])
    k = 1 if kind in ("all_gather", "ppermute") else n
    assert run.before.shape == (n, k) and run.before[n - 1, k - 1] == 10 * (n - 1) + k - 1
    np.testing.assert_array_equal(run.after, expected_after(kind, run.before))
    everyone = (1 << n) - 1
    sources = {  # which devices' data each value holds, as the collective's definition says
        "psum": np.full((n, n), everyone),
        "all_gather": np.tile(1 << np.arange(n), (n, 1)),
        "psum_scatter": np.full((n, 1), everyone),
        "all_to_all": np.tile(1 << np.arange(n), (n, 1)),
        "ppermute": np.roll(1 << np.arange(n), 1)[:, None],
    }[kind]
    np.testing.assert_array_equal(run.sources_after, sources)
    assert run.call.startswith(f"lax.{kind}(x, 'data'")


@pytest.mark.parametrize("n", COUNTS)
def test_all_gather_picture_draws_the_gathered_array_on_every_device(n):
    fig = diagrams.collective("all_gather", n)
    ax = fig.axes[0]
    gathered = np.arange(n) * 10.0
    after = [
        t for t in ax.texts if re.fullmatch(r"Σ?\s?\d+", t.get_text()) and t.get_position()[0] > 1
    ]
    values = np.array([float(t.get_text()) for t in after]).reshape(n, n)  # row-major from the top
    np.testing.assert_array_equal(values, np.tile(gathered, (n, 1)))
    assert len(boxes(fig)) == n + n * n  # one box per value, before and after
    assert [t.get_text() for t in ax.texts if t.get_text().startswith("device")] == [
        f"device {i}" for i in range(n)
    ]
    for box, text in zip(
        boxes(fig)[n:], after
    ):  # each gathered value in its source device's colour
        source = int(float(text.get_text())) // 10
        assert mpl.colors.same_color(box.get_facecolor(), diagrams.device_color(source))


def test_a_sum_is_marked_and_striped_with_every_contributor():
    fig = diagrams.collective("psum", 4)
    sums = [t for t in fig.axes[0].texts if t.get_text().startswith("Σ")]
    assert [t.get_text() for t in sums[:4]] == ["Σ 60", "Σ 64", "Σ 68", "Σ 72"] and len(sums) == 16
    stripes = [p for p in fig.axes[0].patches if not isinstance(p, FancyBboxPatch)]
    assert len(stripes) == 16 * 4  # 16 sums, 4 contributors each


@pytest.mark.parametrize(
    "args, match",
    [
        (("gather", 4), "choose one of"),
        (("psum", 0), "from 1 to 16"),
        (("psum", True), "from 1 to 16"),
        (("psum", 17), "from 1 to 16"),
        (("psum", 9), "only 8 devices"),
    ],
)
def test_collective_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        diagrams.run_collective(*args)


# --- data parallelism ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", COUNTS)
def test_data_parallel_has_a_column_per_device_with_its_batch_shard(n):
    params = param_zeros()
    fig = diagrams.data_parallel(n, 24 * n, (16, 16, 3), params)
    all_text = texts(fig)
    assert [t for t in all_text if t.startswith("device ")] == [f"device {i}" for i in range(n)]
    batch = [t for t in all_text if ": images " in t]
    assert len(batch) == n and all(shapes_in(t) == [(24, 16, 16, 3)] for t in batch)
    assert batch[-1].split("\n")[0].endswith(f"images {24 * (n - 1)}–{24 * n - 1}")
    assert sum(f"θ: {model.param_count(params):,} values" in t for t in all_text) == n
    assert len(device_boxes(fig)) == 2 * n  # the batch shard and the gradient are each device's own
    assert sum("all-reduce" in t for t in all_text) == 1


@pytest.mark.parametrize("n", (1, 2, 4))
def test_the_gradient_all_reduce_drawn_is_in_the_compiled_program(n):
    """The band says all-reduce at every device count; the compiled data-parallel gradient has one."""
    mesh = Mesh(np.array(jax.devices()[:n]), (DATA,))

    def grad(w, x):
        return jax.grad(lambda w: lax.pmean(jnp.sum((x @ w) ** 2), DATA))(w)

    f = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P()))
    hlo = f.lower(jnp.ones((4, 3)), jnp.ones((8, 4))).compile().as_text()
    assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") == 1
    assert any(t.startswith("all-reduce") for t in texts(diagrams.data_parallel(n, 8)))


def test_data_parallel_rejects_an_indivisible_batch():
    with pytest.raises(ValueError, match="global batch 10 is not divisible by 4"):
        diagrams.data_parallel(4, 10)


# --- tensor parallelism: the f / g drawn are the psums of the differentiated program ---------------


def psum_shapes(fn, *args) -> list[tuple[int, ...]]:
    """Input shapes of every psum in the jaxpr of ``fn`` (inside shard_map and other nested jaxprs)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("psum"):
                found.extend(tuple(v.aval.shape) for v in eqn.invars)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sorted(found)


def drawn_psums(fig) -> list[tuple[int, ...]]:
    bands = [t for t in texts(fig) if t.startswith("forward:")]
    return sorted(
        s for t in bands for line in t.split("\n") if "psum" in line for s in shapes_in(line)
    )


ALT_SPECS = {  # conv1 whole, conv2 out-split -> conv3 in-split, dense1 out-split -> dense2 in-split
    "conv1": {"kernel": P(), "bias": P()},
    "conv2": {"kernel": P(None, None, None, MODEL), "bias": P(MODEL)},
    "conv3": {"kernel": P(None, None, MODEL, None), "bias": P()},
    "dense1": {"kernel": P(None, MODEL), "bias": P(MODEL)},
    "dense2": {"kernel": P(MODEL, None), "bias": P()},
}


def alt_apply(p, x):
    """Per-shard forward of the alternative layout (the test's own, to check the picture against)."""
    relu, pool, conv = jax.nn.relu, model.max_pool, parallel.conv
    x = pool(relu(conv(x, p["conv1"]["kernel"], p["conv1"]["bias"])))
    x = pool(relu(conv(x, p["conv2"]["kernel"], p["conv2"]["bias"])))  # channels split
    x = lax.psum(conv(x, p["conv3"]["kernel"]), MODEL) + p["conv3"]["bias"]
    x = relu(
        model.flatten_channel_major(pool(relu(x))) @ p["dense1"]["kernel"] + p["dense1"]["bias"]
    )
    return lax.psum(x @ p["dense2"]["kernel"], MODEL) + p["dense2"]["bias"]


@pytest.mark.parametrize("m", (2, 4))
@pytest.mark.parametrize("layout", ["tp", "alternative"])
def test_cnn_f_and_g_are_the_psums_of_the_gradient_program(layout, m):
    params = param_zeros()
    specs, apply = (parallel.tp_param_specs(params), parallel.tp_apply)
    if layout == "alternative":
        specs, apply = ALT_SPECS, alt_apply
    mesh, images = Mesh(np.array(jax.devices()[:m]), (MODEL,)), jnp.ones((4, 16, 16, 3))
    grads = jax.shard_map(
        lambda p, x: jax.grad(lambda p: jnp.sum(apply(p, x)))(p),
        mesh=mesh,
        in_specs=(specs, P()),
        out_specs=specs,
    )
    program = psum_shapes(grads, params, images)
    fig = diagrams.tensor_parallel_cnn(model.TINY, m, 4, layout)
    assert drawn_psums(fig) == program and len(program) == 4 - (layout == "tp")


def test_the_alternative_layout_by_name_is_the_tests_own_specs():
    by_name = texts(diagrams.tensor_parallel_cnn(model.TINY, 2, 4, "alternative"))
    by_specs = texts(diagrams.tensor_parallel_cnn(model.TINY, 2, 4, ALT_SPECS))
    assert by_name[:-1] == by_specs[:-1] and "'custom' layout" in by_specs[-1]


@pytest.mark.parametrize("m", (1, 2, 4))
def test_mlp_f_and_g_are_the_psums_of_the_gradient_program(m):
    w1, w2 = jnp.ones((6, 8)), jnp.ones((8, 5))

    def grads(w1, w2, x):  # per shard: w1 [6, 8/m], w2 [8/m, 5]; x whole, its gradient wanted
        loss = lambda w1, w2, x: jnp.sum(lax.psum(jax.nn.gelu(x @ w1) @ w2, MODEL))
        return jax.grad(loss, argnums=(0, 1, 2))(w1, w2, x)

    mesh = Mesh(np.array(jax.devices()[:m]), (MODEL,))
    specs = (P(None, MODEL), P(MODEL, None), P())
    f = jax.shard_map(grads, mesh=mesh, in_specs=specs, out_specs=specs)
    fig = diagrams.megatron_mlp(3, 6, 8, 5, m)
    assert drawn_psums(fig) == psum_shapes(f, w1, w2, jnp.ones((3, 6))) == [(3, 5), (3, 6)]


@pytest.mark.parametrize("m", (1, 2, 4, 8))
def test_cnn_labels_carry_the_shard_shapes_of_the_placed_kernels(m):
    config = model.CNNConfig(image_size=16, channels=(8, 16, 16), hidden=16)  # divisible by 8
    params = param_zeros(config)
    mesh = meshes.data_model_mesh(jax.devices(), (8 // m, m))
    specs = parallel.tp_param_specs(params)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    fig = diagrams.tensor_parallel_cnn(config, m, 8, "tp")
    kernels = {t.split("\n")[0] for t in texts(fig) if t.startswith("W [")}
    expected = {
        f"W {list(layer['kernel'].addressable_shards[0].data.shape)}" for layer in placed.values()
    }
    assert kernels == expected
    assert (
        len(device_boxes(fig)) == 4 * m
    )  # conv1, conv2, conv3, dense1 are split; a box per model shard


@pytest.mark.parametrize("m", COUNTS)
def test_mlp_shard_shapes_at_every_model_axis_size(m):
    fig = diagrams.megatron_mlp(8, 64, 24, 16, m)
    assert [t.split("\n")[0] for t in texts(fig) if t.startswith("W [")] == (
        [f"W [64, {24 // m}]"] * m + [f"W [{24 // m}, 16]"] * m
    )
    assert [t for t in texts(fig) if t.startswith("model shard")] == [
        f"model shard {k}" for k in range(m)
    ]


def test_tensor_parallel_errors_name_the_layer_and_the_fix():
    with pytest.raises(ValueError, match="conv1: 32 features are not divisible by 3 model shards"):
        diagrams.tensor_parallel_cnn(model.CNNConfig(), 3, 8)
    with pytest.raises(ValueError, match="dense1: 10 features are not divisible by 4"):
        diagrams.megatron_mlp(8, 16, 10, 4, 4)
    bad = dict(ALT_SPECS, conv1={"kernel": P(None, None, MODEL, None)})
    with pytest.raises(
        ValueError, match=r"conv1 has split 'in'; after \[4, 16, 16, 3\] it needs 'out'"
    ):
        diagrams.tensor_parallel_cnn(model.TINY, 2, 4, bad)
    with pytest.raises(ValueError, match="give one of"):
        diagrams.tensor_parallel_cnn(model.TINY, 2, 4, "megatron")


# --- sharding layouts: drawn from the placed array ---------------------------------------------------


LAYOUTS = [
    ((8,), P(DATA)),
    ((8,), P(None, DATA)),
    ((4, 2), P(DATA, MODEL)),
    ((4, 2), P(MODEL, DATA)),
    ((4, 2), P(DATA, None)),
    ((4, 2), P(None, MODEL)),
    ((4, 2), P()),
    ((4, 2), P((DATA, MODEL), None)),
]


@pytest.mark.parametrize("mesh_shape, spec", LAYOUTS, ids=str)
def test_array_sharding_draws_each_shard_with_its_devices_and_shape(mesh_shape, spec):
    names = (DATA, MODEL)[: len(mesh_shape)]
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
    x = jax.device_put(jnp.arange(8 * 16.0).reshape(8, 16), NamedSharding(mesh, spec))
    fig = diagrams.array_sharding(x)
    holders = {}
    for shard in x.addressable_shards:
        holders.setdefault(str(shard.index), []).append(shard)
    assert len(boxes(fig)) == len(holders)  # a box per distinct block; per device when fully split
    labels = sorted(t for t in texts(fig) if t.startswith("device"))
    assert labels == sorted(label(s) for s in holders.values())
    if len(holders) == 8:  # fully split: each block where its index says, in its device's colour
        h, w = x.addressable_shards[0].data.shape
        at = {(b.get_x(), b.get_y()): b.get_facecolor() for b in boxes(fig)}
        rows = 8 // h
        for shard in x.addressable_shards:
            r, c = (shard.index[0].start or 0) // h, (shard.index[1].start or 0) // w
            assert mpl.colors.same_color(
                at[(c, rows - 1 - r)], diagrams.device_color(shard.device.id)
            )


def label(shards) -> str:
    """The label a block held by ``shards`` should carry: its devices, then its shape."""
    ids = sorted(s.device.id for s in shards)
    shape = f"[{', '.join(map(str, shards[0].data.shape))}]"
    if len(ids) == 1:
        return f"device {ids[0]}\n{shape}"
    run = len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1))
    return (
        f"devices\n{ids[0]}–{ids[-1]}\n{shape}"
        if run
        else f"devices {', '.join(map(str, ids))}\n{shape}"
    )


@pytest.mark.parametrize("n", COUNTS)
def test_array_sharding_has_a_block_per_device_at_any_count(n):
    mesh = Mesh(np.array(jax.devices()[:n]), (DATA,))
    x = jax.device_put(jnp.zeros(6 * n), NamedSharding(mesh, P(DATA)))
    fig = diagrams.array_sharding(x)
    assert len(boxes(fig)) == n
    assert sorted(t for t in texts(fig) if t.startswith("device")) == sorted(
        f"device {i}\n[6]" for i in range(n)
    )


def test_array_sharding_sends_nd_arrays_to_the_table():
    with pytest.raises(ValueError, match="not \\(3, 3, 4\\); see sharding_table"):
        diagrams.array_sharding(jnp.zeros((3, 3, 4)))


def test_sharding_table_writes_each_kernels_per_device_shape():
    params = param_zeros()
    mesh = meshes.data_model_mesh(jax.devices(), (4, 2))
    specs = parallel.tp_param_specs(params)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    fig = diagrams.sharding_table(placed)
    rows = [t for t in texts(fig) if t.startswith("per device")]
    leaves = jax.tree.leaves(placed)
    assert [shapes_in(t)[0] for t in rows] == [x.addressable_shards[0].data.shape for x in leaves]
    split = [t for t in texts(fig) if " / model\n→ " in t]
    assert len(split) == sum(
        s is not None
        for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        for s in spec
    )
    assert (
        "conv1/kernel" in texts(fig)
        and "per device [3, 3, 3, 2]: 2 shards, each on 4 devices" in rows
    )
    assert "per device [10]: whole on 8 devices" in rows
    one = texts(diagrams.sharding_table({"w": jnp.ones((3, 2))}))  # not placed: on one device
    assert "per device [3, 2]: whole on 1 device" in one and "Shardings on mesh (1 device)" in one


# --- treescope: N-D shardings as HTML ---------------------------------------------------------------


def test_treescope_renders_a_4d_kernel_sharding_as_self_contained_html():
    import nbformat
    from nbconvert import HTMLExporter

    mesh = meshes.data_model_mesh(jax.devices(), (4, 2))
    kernel = jax.device_put(
        jnp.zeros((3, 3, 8, 16)), NamedSharding(mesh, P(None, None, DATA, MODEL))
    )
    html = treescope.render_array_sharding(kernel)._repr_html_()
    assert "<treescope-container" in html and not re.search(r"(src|href)=|https?://", html)
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("treescope.render_array_sharding(k)")]
    )
    nb.cells[0].outputs = [
        nbformat.v4.new_output("execute_result", {"text/html": html, "text/plain": "…"})
    ]
    page, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    assert "<treescope-container" in page and "customElements.define" in page  # kept, not sanitised


# --- every picture behaves like a plot function -------------------------------------------------------


PICTURES = [
    "collective",
    "data_parallel",
    "megatron_mlp",
    "tensor_parallel_cnn",
    "array_sharding",
    "sharding_table",
]


def draw(name, ax=None, n=8):
    """One picture at ``n`` devices (model shards: the largest of 1, 2, 4 that fits)."""
    m = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    if name == "collective":
        return diagrams.collective("all_to_all", n, ax=ax)
    if name == "data_parallel":
        return diagrams.data_parallel(n, 8 * n, (16, 16, 3), param_zeros(), ax=ax)
    if name == "megatron_mlp":
        return diagrams.megatron_mlp(8, 64, 256, 64, m, ax=ax)
    if name == "tensor_parallel_cnn":
        return diagrams.tensor_parallel_cnn(model.CNNConfig(), m, 16, ax=ax)
    mesh = meshes.data_model_mesh(jax.devices()[:n], (n // m, m))
    if name == "array_sharding":
        x = jax.device_put(jnp.zeros((2 * n, 16)), NamedSharding(mesh, P(DATA, MODEL)))
        return diagrams.array_sharding(x, ax=ax)
    specs = parallel.tp_param_specs(None)
    placed = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), param_zeros(), specs
    )
    return diagrams.sharding_table(placed, ax=ax)


@pytest.mark.parametrize("name", PICTURES)
def test_a_picture_is_one_figure_or_the_given_axes_and_leaves_global_style_alone(name, monkeypatch):
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("plt.show() called"))
    style = dict(mpl.rcParams)
    before = plt.get_fignums()
    fig = draw(name)
    assert isinstance(fig, mpl.figure.Figure) and len(plt.get_fignums()) == len(before) + 1
    assert dict(mpl.rcParams) == style
    plt.close(fig)
    assert plt.get_fignums() == before
    host, ax = plt.subplots()
    assert draw(name, ax) is host and plt.get_fignums() == [*before, host.number] and ax.texts


@pytest.mark.parametrize("n", (1, 3, 8))
@pytest.mark.parametrize("name", PICTURES)
def test_no_two_labels_overlap_and_none_is_below_5_points(name, n):
    fig = draw(name, n=n)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for ax in fig.axes for t in [*ax.texts, ax.title, ax._left_title] if t.get_text()]
    assert min(t.get_fontsize() for t in labels) >= 5
    extents = [t.get_window_extent(renderer) for t in labels]
    for i, a in enumerate(extents):
        for j, b in enumerate(extents[i + 1 :], i + 1):
            assert not a.overlaps(b), f"{labels[i].get_text()!r} overlaps {labels[j].get_text()!r}"


def test_device_colours_are_matplotlibs_colour_blind_safe_sequence():
    palette = mpl.color_sequences["petroff10"]
    assert [diagrams.device_color(i) for i in range(10)] == [tuple(c) for c in palette]
    assert diagrams.device_color(10) == diagrams.device_color(0)
