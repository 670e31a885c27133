"""course_lib.lm_layouts: the transformer lab's layouts — meshes, specs, parity with one device, bytes and
memory beside the compiled programs, the step-time model (8 simulated CPU devices, conftest.py). Parity
with one device, float64 and float32, for every layout at every step: asserted in
notebooks/12_transformer_lab.ipynb at every device count it runs."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from course_lib import comms, lm_costs, lm_layouts, lm_runs, transformer
from course_lib.tokens import CopyWalk

CFG = transformer.TINY
ONCE = {"xla_backend_optimization_level": 0}


def test_mesh_axes_shrink_the_first_axis_and_skip_what_does_not_fit():
    assert lm_layouts.mesh_axes("tp_sp", 8) == {"data": 4, "model": 2}
    assert lm_layouts.mesh_axes("pp_dp", 2) == {"data": 1, "stage": 2}
    assert lm_layouts.mesh_axes("3d", 8) == {"data": 2, "fsdp": 2, "model": 2}
    assert lm_layouts.mesh_axes("3d", 4) == {"data": 1, "fsdp": 2, "model": 2}
    assert lm_layouts.mesh_axes("3d", 2) is None and lm_layouts.mesh_axes("tp_sp", 1) is None
    assert lm_layouts.mesh_axes("dp", 1) == {"data": 1}
    with pytest.raises(ValueError, match="unknown layout 'zero'"):
        lm_layouts.layout("zero")


def _runnable(n):
    return [k for k in lm_layouts.LAYOUTS if lm_layouts.mesh_axes(k, n)]


@pytest.mark.parametrize(
    "n, batch, multiple, nearest, layout",
    [
        (8, 12, 8, "8 or 16", "dp"),
        (8, 7, 8, "8", "dp"),
        (3, 16, 3, "15 or 18", "dp"),
        (5, 16, 5, "15 or 20", "dp"),
        (7, 16, 7, "14 or 21", "dp"),
        (6, 16, 6, "12 or 18", "dp"),
    ],
)
def test_check_run_refuses_a_batch_a_layout_does_not_split(n, batch, multiple, nearest, layout):
    with pytest.raises(
        ValueError,
        match=rf"global batch {batch} does not split over layout '{layout}' on {n} device\(s\).*"
        rf"set global_batch to a multiple of {multiple}.*\(e\.g\. {nearest}\)",
    ):
        lm_runs.check_run(_runnable(n), n, batch, 3)


def test_check_run_names_the_pipelines_micro_batches():
    # on 8 devices without dp: pp_dp needs 4 data shards x 2 micro-batches, the others 4
    keys = [k for k in _runnable(8) if k != "dp"]
    with pytest.raises(
        ValueError, match=r"layout 'pp_dp'.*multiple of 8 \(4 data shards x 2 micro"
    ):
        lm_runs.check_run(keys, 8, 12, 3)
    with pytest.raises(ValueError, match=r"layout 'ep_dp'.*multiple of 8 \(8 data shards\)"):
        lm_runs.check_run([k for k in keys if k != "pp_dp"], 8, 12, 3)  # ep_dp: data=4 x expert=2
    lm_runs.check_run([k for k in keys if k not in ("pp_dp", "ep_dp")], 8, 12, 3)


@pytest.mark.parametrize("steps", [0, -1])
def test_check_run_refuses_fewer_than_one_step(steps):
    with pytest.raises(ValueError, match=rf"steps={steps!r}: .*set steps to 1 or more"):
        lm_runs.check_run(_runnable(8), 8, 16, steps)


@pytest.mark.parametrize(
    "name, value",
    [
        ("steps", "3"),
        ("steps", 2.5),
        ("steps", True),
        ("global_batch", 16.0),
        ("global_batch", "16"),
        ("n_micro", "2"),
    ],
)
def test_check_run_names_a_value_that_is_not_a_whole_number(name, value):
    # papermill -r passes text, a YAML 16.0 a float: the message says so, not "fewer than one step"
    kwargs = {"global_batch": 16, "steps": 3, "n_micro": 2, name: value}
    with pytest.raises(
        ValueError, match=rf"^{name}={value!r} is a {type(value).__name__}, not a whole number"
    ):
        lm_runs.check_run(_runnable(8), 8, **kwargs)


@pytest.mark.parametrize("n_micro", [0, -2])
def test_check_run_refuses_a_pipeline_without_micro_batches(n_micro):
    with pytest.raises(ValueError, match=rf"n_micro={n_micro}: .*at least 1 micro-batch"):
        lm_runs.check_run(_runnable(8), 8, 16, 3, n_micro=n_micro)


def test_why_not_names_the_device_count_a_layout_needs():
    assert lm_runs.why_not("dp", 5) is None and lm_runs.why_not("tp_sp", 4) is None
    for n in (5, 7, 9):
        assert lm_runs.why_not("tp_sp", n) == "needs a multiple of 2 devices (model=2)"
    assert lm_runs.why_not("3d", 6) == "needs a multiple of 4 devices (fsdp=2 x model=2)"
    assert lm_runs.why_not("3d", 2) == "needs a multiple of 4 devices (fsdp=2 x model=2)"


def test_check_run_shows_numpy_values_as_plain_numbers():
    import numpy as np

    with pytest.raises(ValueError, match=r"^steps=0: "):
        lm_runs.check_run(_runnable(8), 8, 16, np.int64(0))
    lm_runs.check_run(_runnable(8), 8, np.int64(16), np.int64(2))


@pytest.mark.parametrize("batch", [0, -8])
def test_check_run_refuses_a_batch_below_one(batch):
    with pytest.raises(ValueError, match=rf"global_batch={batch!r}: .*positive multiple of 8"):
        lm_runs.check_run(_runnable(8), 8, batch, 3)


def test_check_run_accepts_what_the_lab_runs_and_refuses_a_layout_that_does_not_fit():
    for n, batch in ((1, 7), (2, 16), (3, 12), (4, 16), (6, 12), (8, 16), (8, 8)):
        lm_runs.check_run(_runnable(n), n, batch, 1)
    assert lm_runs.batch_divisor("pp_dp", 8) == 8 and lm_runs.batch_divisor("3d", 8) == 4
    assert lm_runs.batch_divisor("3d", 6) is None
    with pytest.raises(ValueError, match=r"layout '3d' does not fit 6 device\(s\)"):
        lm_runs.check_run(["3d"], 6, 12, 3)


def test_specs_split_heads_and_mlp_over_model_and_the_rest_over_fsdp():
    params = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), CFG)[1])
    specs = lm_layouts.param_specs("3d", params, {"data": 2, "fsdp": 2, "model": 2})
    assert specs["blocks"]["attn"]["wq"]["kernel"] == jax.P(None, "fsdp", "model", None)
    assert specs["blocks"]["attn"]["wo"]["kernel"] == jax.P(None, "model", "fsdp", None)
    assert specs["blocks"]["mlp"]["w2"]["kernel"] == jax.P(None, "model", "fsdp")
    assert specs["embed"]["embedding"] == jax.P("fsdp", None)
    dp = lm_layouts.param_specs("dp", params, {"data": 8})
    assert all(
        s == jax.P(*([None] * len(s)))
        for s in jax.tree.leaves(dp, is_leaf=lambda x: isinstance(x, jax.P))
    )


def _setup(dtype=jnp.float32):
    params = jax.jit(lambda k: transformer.init_model(k, CFG)[1])(jax.random.key(0))
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    tokens, targets = CopyWalk(CFG.vocab, CFG.seq_len).batch(jax.random.key(1), 16)
    return params, lm_layouts.init_momentum(params), tokens, targets


@pytest.mark.parametrize(("key", "n"), [("pp_dp", 8), ("3d", 8), ("tp_sp", 8), ("3d", 4)])
def test_bytes_and_memory_predicted_equal_the_compiled_program(report, key, n):
    # every layout at every count: in the notebook, every run; here FSDP+TP+DP at once, SP, the pipeline,
    # and a mesh with an axis of size 1 (3d on 4 devices: data=1, which sends nothing)
    built = lm_layouts.build(key, CFG, report.devices[:n], compiler_options=ONCE)
    compiled = built.lower(*built.place(*_setup())).compile()
    got = comms.collectives(compiled.as_text(), built.sizes)
    want = lm_costs.predict_bytes(key, CFG, 16, built.sizes, itemsize=4)
    nonzero = lambda items: {a: b for a, b in comms.sent_by_axis(items).items() if b}  # noqa: E731
    assert comms.same_by_axis(nonzero(want), nonzero(got))
    for row in lm_costs.by_kind(want, got):  # per axis and kind too
        assert comms.same_bytes(row["predicted_bytes"], row["measured_bytes"]), row
    mem, ma = lm_costs.predict_memory(key, CFG, 16, built.sizes, 4), compiled.memory_analysis()
    assert (mem["arguments"], mem["outputs"]) == (
        ma.argument_size_in_bytes,
        ma.output_size_in_bytes,
    )


def test_the_partitioner_variant_computes_the_same_loss_and_sends_other_collectives(report):
    params, velocity, tokens, targets = _setup()
    ref = jax.jit(lm_layouts.reference_step(CFG))(params, velocity, tokens, targets)
    auto = lm_layouts.build("tp_sp", CFG, report.devices, compiler_options=ONCE, partitioner=True)
    placed = auto.place(params, velocity, tokens, targets)
    compiled = auto.lower(*placed).compile()
    assert abs(float(compiled(*placed)[2]) - float(ref[2])) < 1e-5
    kinds = {(c.axis, c.kind) for c in comms.collectives(compiled.as_text(), auto.sizes)}
    assert ("model", "all-to-all") in kinds  # XLA:CPU's choice; the hand-written step has none


def test_build_refuses_a_device_count_that_does_not_fit(report):
    with pytest.raises(ValueError, match="layout '3d' needs a multiple of 4 devices; 2 given"):
        lm_layouts.build("3d", CFG, report.devices[:2])


def test_the_step_time_model_ranks_fitting_layouts_and_the_memory_model_is_monotone():
    gpu = transformer.GPU
    rows = lm_costs.rank_layouts(gpu, 64, lm_costs.FABRICS["H100"], 8)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert {r["layout"] for r in rows} == set(lm_layouts.DENSE_KEYS)  # ep_dp: another model
    tight = lm_costs.rank_layouts(gpu, 64, lm_costs.FABRICS["H100"], 8, memory_limit=56e9)
    assert tight and all(r["memory_bytes"] <= 56e9 for r in tight) and len(tight) < len(rows)
    small = lm_costs.largest_layers("fsdp_tp", gpu, 16, 24e9)
    assert 0 < small <= lm_costs.largest_layers("fsdp_tp", gpu, 16, 48e9)
    assert lm_costs.largest_layers("pp_dp", gpu, 32, 24e9) % 2 == 0
    assert lm_costs.largest_layers("dp", gpu, 64, 1e9) == 0
    assert not lm_costs.splits(
        "tp_sp", dataclasses.replace(CFG, n_heads=1, d_model=33), 16, {"data": 4, "model": 2}
    )


def test_the_step_time_model_at_a_fraction_of_the_peak_with_overlap_and_remat():
    gpu, h100 = transformer.GPU, lm_costs.FABRICS["H100"]
    full = lm_costs.step_time("dp", gpu, 64, h100)
    half = lm_costs.step_time("dp", gpu, 64, h100, mfu=0.5)
    assert half["flop_s"] == pytest.approx(2 * full["flop_s"]) and half["hbm_s"] == full["hbm_s"]
    assert half["comm_s"] == full["comm_s"] and half["step_s"] > full["step_s"]
    # the three ways of adding communication to compute, in order; the default is the sum
    for key in ("dp", "tp_sp", "pp_dp"):
        row = lm_costs.step_time(key, gpu, 64, h100)
        assert row["overlap_s"] <= row["data_overlap_s"] <= row["no_overlap_s"] == row["step_s"]
        assert row["no_overlap_s"] == pytest.approx(row["compute_s"] + sum(row["comm_s"].values()))
    # DP's traffic is all gradients: hidden under "data"; TP+SP's all-gathers stay on the critical path
    assert lm_costs.step_time("dp", gpu, 64, h100)["critical_s"] == 0
    assert lm_costs.step_time("tp_sp", gpu, 64, h100)["critical_s"] > 0
    with pytest.raises(ValueError, match="overlap='some'"):
        lm_costs.step_time("dp", gpu, 64, h100, overlap="some")
    # recomputation: a quarter more block FLOPs, a fraction of the activations
    plain, remat = (lm_costs.step_time("dp", gpu, 64, h100, remat=r) for r in (False, True))
    assert remat["flop_s"] > plain["flop_s"] and remat["memory_bytes"] < plain["memory_bytes"] / 4


def test_the_pipeline_model_is_the_executor_it_runs():
    """pp_dp as lesson 11's executor runs it: m + 1 stashed inputs (and xs, dxs, the tick buffers), one
    micro-batch's stage values recomputed; every tick runs the stage and the head (idle ones too)."""
    gpu, sizes = transformer.GPU, lm_layouts.mesh_axes("pp_dp", 8)
    acts = lm_costs.activation_bytes("pp_dp", gpu, 32, sizes, 2, 8)
    assert (
        3e9 < acts < 4e9
    )  # the figure: about 3.4 GB held, where GPipe keeping all would be 26 GB
    # the stash grows with the micro-batches at a fixed micro-batch size, the recomputed values do not
    a8, a16 = (lm_costs.activation_bytes("pp_dp", gpu, 32 * k, sizes, 2, 8 * k) for k in (1, 2))
    assert (
        a16 - a8 == 3 * 8 * 1 * gpu.seq_len * gpu.d_model * 2
    )  # 3 (m) more, b/m = 1 sequence each
    assert lm_costs.activation_bytes("pp_dp", gpu, 32, sizes, 2, 8, remat=True) == acts
    with pytest.raises(ValueError, match="n_micro=3"):
        lm_costs.activation_bytes("pp_dp", gpu, 32, sizes, 2, 3)
    fb = transformer.flops_per_token(gpu) - 2 * gpu.d_model * gpu.vocab
    fh = 2 * gpu.d_model * gpu.vocab
    got = lm_costs.flops_per_device("pp_dp", gpu, 32, sizes, 8)
    assert got == pytest.approx((4 * fb / 2 + 4 * fh) * 1 * gpu.seq_len * 9)


def test_fsdp_keeps_the_parameters_it_gathers_in_the_memory_model():
    # the step gathers every fsdp-split parameter once and keeps it through the backward pass
    sizes = lm_layouts.mesh_axes("fsdp_tp", 8)
    assert lm_costs.gathered_bytes("dp", CFG, {"data": 8}) == 0
    whole = lm_costs.gathered_bytes("fsdp_tp", CFG, sizes)
    gathers = lm_costs.predict_bytes("fsdp_tp", CFG, 16, sizes)
    assert whole == sum(
        t.size_bytes for t in gathers if t.kind == "all-gather" and t.axis == "fsdp"
    )
    mem = lm_costs.predict_memory("fsdp_tp", CFG, 16, sizes)
    assert mem["activations"] == lm_costs.activation_bytes("fsdp_tp", CFG, 16, sizes) > whole


def test_the_roofline_model_counts_hbm_traffic_only_where_a_step_is_memory_bound():
    gpu, h100, h200 = transformer.GPU, lm_costs.FABRICS["H100"], lm_costs.FABRICS["H200"]
    sizes = lm_layouts.mesh_axes("dp", 8)
    prm = lm_costs.param_bytes("dp", gpu, sizes, 2)
    acts = lm_costs.activation_bytes("dp", gpu, 8, sizes, 2)
    # 2 parameter reads, 6 parameter-sized gradient and update terms, the activations written and read
    assert lm_costs.hbm_bytes("dp", gpu, 8, sizes) == 8 * prm + 2 * acts
    # FSDP: the gathered copy is read twice, and activation_bytes holds it once: 8 p + 2 A all the same
    sizes = lm_layouts.mesh_axes("fsdp_tp", 8)
    mem = lm_costs.predict_memory("fsdp_tp", gpu, 8, sizes, 2)
    expected = 8 * mem["params"] + 2 * mem["activations"]
    assert lm_costs.hbm_bytes("fsdp_tp", gpu, 8, sizes) == expected
    plain = lm_costs.step_time("dp", gpu, 256, h100, roofline=False)
    big = [lm_costs.step_time("dp", gpu, 256, p) for p in (h100, h200)]  # the roofline: the default
    assert all(r["flop_s"] > r["hbm_s"] for r in big)  # compute-bound: the roofline changes nothing
    assert big[0]["step_s"] == big[1]["step_s"] == plain["step_s"]
    short = dataclasses.replace(gpu, seq_len=256)
    small = [lm_costs.step_time("dp", short, 8, p, roofline=True) for p in (h100, h200)]
    assert all(r["hbm_s"] > r["flop_s"] for r in small)  # memory-bound: the faster HBM counts
    assert small[1]["step_s"] < small[0]["step_s"]
    assert small[0]["hbm_s"] / small[1]["hbm_s"] == pytest.approx(4.8 / 3.35)


def test_the_pipeline_as_compiled_holds_every_b_ticks_recomputation():
    """compiled=True: the m + p - 1 B ticks' recomputed stage values and logits at once (XLA:CPU's unrolled
    schedule), beside the same stash, xs, dxs and tick buffers; only the pipeline has it."""
    gpu, sizes = transformer.GPU, lm_layouts.mesh_axes("pp_dp", 8)
    for m in (2, 8):
        algo = lm_costs.activation_bytes("pp_dp", gpu, 32, sizes, 2, m)
        held = lm_costs.activation_bytes("pp_dp", gpu, 32, sizes, 2, m, compiled=True)
        buffers = (3 * m + 4) * (32 // 4 // m) * gpu.seq_len * gpu.d_model * 2
        assert held - buffers == (m + 2 - 1) * (algo - buffers)  # p = 2 stages
    assert lm_costs.activation_bytes(
        "dp", gpu, 8, lm_layouts.mesh_axes("dp", 8), 2, compiled=True
    ) == (lm_costs.activation_bytes("dp", gpu, 8, lm_layouts.mesh_axes("dp", 8), 2))


@pytest.mark.parametrize("overlap", lm_costs.OVERLAPS)
def test_the_time_breakdown_stacks_to_the_step(overlap):
    """compute + bubble + exposed = step_s; exposed + hidden = the communication; the bubble is the
    pipeline's (p - 1)/(m + p - 1) of its compute, 0 elsewhere; a row of another kind is refused."""
    h100 = lm_costs.FABRICS["H100"]
    for row in lm_costs.rank_layouts(transformer.GPU, 64, h100, 8, overlap=overlap):
        part = lm_costs.time_breakdown(row)
        assert part["compute"] + part["bubble"] + part["exposed communication"] == pytest.approx(
            row["step_s"], rel=1e-12
        )
        assert part["exposed communication"] + part["overlapped communication"] == pytest.approx(
            sum(row["comm_s"].values()), rel=1e-12
        )
        assert min(part.values()) >= -1e-12 * row["step_s"]
        p = row["sizes"].get("stage", 1)
        assert row["bubble_s"] == pytest.approx(row["compute_s"] * (p - 1) / (4 * p + p - 1))
        if overlap == "none":
            assert part["overlapped communication"] == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError, match="bubble_s"):
        lm_costs.time_breakdown({"layout": "dp", "step_s": 1.0})


def test_the_time_breakdown_plot_draws_every_layout():
    import matplotlib

    matplotlib.use("Agg")
    rows = lm_costs.rank_layouts(transformer.GPU, 64, lm_costs.FABRICS["H100"], 8, overlap="data")
    ax = lm_costs.plot_time_breakdown(rows)
    assert [t.get_text() for t in ax.get_xticklabels()] == [r["layout"] for r in rows]
    assert "MODEL" in ax.get_title()


@pytest.mark.parametrize("across", ["data", "model"])
def test_two_nodes_place_the_crossing_axis_between_them(across):
    from course_lib import lm_plots

    sizes = lm_layouts.mesh_axes("tp_sp", 16)  # data=8 x model=2
    placed = lm_plots.node_of(sizes, across)
    assert len(placed) == 16 and sorted(placed.values()).count(0) == 8
    k, other = list(sizes).index(across), 1 - list(sizes).index(across)
    # a group along the crossing axis spans both nodes; one along the other axis stays in one node
    for coord, node in placed.items():
        assert node == coord[k] // (sizes[across] // 2)
        partners = [c for c in placed if c[k] == coord[k]]  # coord's group along the other axis
        assert {placed[c] for c in partners} == {node} and len(partners) == sizes[
            list(sizes)[other]
        ]
    with pytest.raises(ValueError, match="not an axis"):
        lm_plots.node_of(sizes, "stage")
    with pytest.raises(ValueError, match="do not divide"):
        lm_plots.node_of({"data": 3, "model": 2}, "data")


def test_the_two_node_picture_draws_every_device_and_both_links():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import lm_plots

    sizes = lm_layouts.mesh_axes("tp_sp", 16)
    ax = lm_plots.plot_two_nodes(sizes, "model")
    assert len(ax.patches) == 2 + 16  # two nodes, sixteen devices
    texts = [t.get_text() for t in ax.texts]
    assert "InfiniBand NDR" in texts and sum("NVLink 4" in t for t in texts) == 2
    assert sum(t.startswith("data ") for t in texts) == 16
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [
        "one model group (2 devices): on InfiniBand NDR",
        "one data group (8 devices): on NVLink 4",
    ]
    plt.close("all")
