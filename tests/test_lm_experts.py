"""course_lib.lm_experts: the transformer lab's expert layout ``ep_dp`` (the MoE transformer on data × expert)
— parity with the one-device MoE transformer in float64 at 2, 4 and 8 simulated CPU devices, bytes per axis
and memory predicted equal to the compiled program's, the step-time model's row, bad input refused.
Asserted at every device count it runs in notebooks/12_transformer_lab.ipynb too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import comms, lm_costs, lm_experts, lm_layouts, lm_runs, strategies, transformer
from course_lib.tokens import CopyWalk

CFG = transformer.TINY
ONCE = {"xla_backend_optimization_level": 0}


def _setup(dtype):
    params = lm_experts.init_params(jax.random.key(0), CFG)
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    tokens, targets = CopyWalk(CFG.vocab, CFG.seq_len).batch(jax.random.key(1), 16)
    return params, lm_layouts.init_momentum(params), tokens, targets


def test_the_layout_is_a_registry_entry_on_data_by_expert():
    assert "ep_dp" in strategies.LAYOUT_KEYS and "ep_dp" not in lm_layouts.DENSE_KEYS
    assert strategies.info("ep_dp").model == "transformer"
    assert lm_layouts.mesh_axes("ep_dp", 8) == {"data": 4, "expert": 2}
    assert lm_layouts.mesh_axes("ep_dp", 2) == {"data": 1, "expert": 2}
    assert lm_layouts.mesh_axes("ep_dp", 1) is None
    assert lm_runs.why_not("ep_dp", 1) == "needs a multiple of 2 devices (expert=2)"
    assert lm_runs.batch_divisor("ep_dp", 8) == 8  # the tokens over both axes


def test_specs_split_the_experts_over_expert_and_replicate_the_rest():
    params = jax.eval_shape(lambda: lm_experts.init_params(jax.random.key(0), CFG))
    specs = lm_layouts.param_specs("ep_dp", params, {"data": 4, "expert": 2})
    moe = specs["blocks"]["moe"]
    assert moe["w1"]["kernel"] == moe["w2"]["bias"] == jax.P(None, "expert")
    assert moe["router"]["kernel"] == specs["blocks"]["attn"]["wq"]["kernel"] == jax.P()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_one_step_equals_the_one_device_moe_transformer_in_float64(report, n):
    with jax.enable_x64(True):
        args = _setup(jnp.float64)
        ref = jax.jit(lm_experts.reference_step(CFG))(*args)
        built = strategies.build_layout("ep_dp", CFG, report.devices[:n], compiler_options=ONCE)
        got = built.step(*built.place(*args))
        worst = max(
            float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True)
        )
    assert worst < 1e-10, worst  # loss, new parameters, momentum and every gradient


@pytest.mark.parametrize("n", [2, 8])
def test_bytes_and_memory_predicted_equal_the_compiled_program(report, n):
    built = lm_layouts.build("ep_dp", CFG, report.devices[:n], compiler_options=ONCE)
    compiled = built.lower(*built.place(*_setup(jnp.float32))).compile()
    got = comms.collectives(compiled.as_text(), built.sizes)
    want = lm_costs.predict_bytes("ep_dp", CFG, 16, built.sizes, itemsize=4)
    nonzero = lambda items: {a: b for a, b in comms.sent_by_axis(items).items() if b}  # noqa: E731
    assert comms.same_by_axis(nonzero(want), nonzero(got))
    assert set(nonzero(got)) == ({"expert", "data", "data,expert"} if n == 8 else {"expert"})
    kinds = {(c.axis, c.kind) for c in got if c.sent_bytes}
    assert {a for a, k in kinds if k == "all-to-all"} == {"expert"}
    if n == 8:  # the experts' gradients over data only, everything else over both axes
        assert kinds == {
            ("expert", "all-to-all"),
            ("data", "all-reduce"),
            ("data,expert", "all-reduce"),
        }
    else:  # data=1: the replicated gradients over expert alone, the experts' reduced nowhere
        assert kinds == {("expert", "all-to-all"), ("expert", "all-reduce")}
    mem, ma = lm_costs.predict_memory("ep_dp", CFG, 16, built.sizes, 4), compiled.memory_analysis()
    assert (mem["arguments"], mem["outputs"]) == (
        ma.argument_size_in_bytes,
        ma.output_size_in_bytes,
    )


def test_the_step_time_model_gives_its_row_beside_the_dense_ranking():
    h100 = lm_costs.FABRICS["H100"]
    row = lm_costs.step_time("ep_dp", transformer.GPU, 64, h100)
    dense = lm_costs.rank_layouts(transformer.GPU, 64, h100, 8)
    assert set(row) == set(dense[0]) and "ep_dp" not in {r["layout"] for r in dense}
    assert row["step_s"] == row["no_overlap_s"] >= row["overlap_s"] > 0
    assert set(row["comm_s"]) == {"expert", "data", "data,expert"}
    bigger = lm_costs.step_time("ep_dp", transformer.GPU, 128, h100)
    assert bigger["flop_s"] == pytest.approx(2 * row["flop_s"])  # the FLOPs are linear in the batch
    # the critical part is the all-to-alls: at 8 devices all of expert's time, at 2 (data=1) not the
    # gradients' all-reduce, which runs over expert there too and overlaps under overlap="data"
    assert row["critical_s"] == pytest.approx(row["comm_s"]["expert"])
    two = lm_costs.step_time("ep_dp", transformer.GPU, 64, h100, 2, overlap="data")
    assert set(two["comm_s"]) == {"expert"} and 0 < two["critical_s"] < two["comm_s"]["expert"]
    rest = two["comm_s"]["expert"] - two["critical_s"]
    assert two["step_s"] == pytest.approx(max(two["compute_s"], rest) + two["critical_s"])


def test_bad_input_is_refused_with_the_value_and_the_fix(report):
    with pytest.raises(
        ValueError, match=r"layout 'ep_dp' needs a multiple of 2 devices \(expert=2\); 1"
    ):
        lm_layouts.build("ep_dp", CFG, report.devices[:1])
    with pytest.raises(ValueError, match="shard_map only; pass partitioner=False"):
        lm_layouts.build("ep_dp", CFG, report.devices[:2], partitioner=True)
    with pytest.raises(
        ValueError, match=r"global_batch=12 does not split over data=4 x expert=2; .*8"
    ):
        lm_experts.predict_bytes(CFG, 12, {"data": 4, "expert": 2})
    with pytest.raises(ValueError, match="does not fit 3 devices"):
        lm_costs.step_time("ep_dp", transformer.GPU, 64, lm_costs.FABRICS["H100"], 3)
    with pytest.raises(ValueError, match="remat is not modelled"):
        lm_costs.predict_memory("ep_dp", CFG, 16, {"data": 4, "expert": 2}, remat=True)
