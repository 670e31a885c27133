"""course_lib.lm_lab: the transformer lab's plumbing — parity runs against the one-device reference, the facts
read from XLA:TPU's committed programs, the decision table, the expert layout's buffers, the step-time table,
and bad input refused. notebooks/12_transformer_lab.ipynb asserts the lesson's claims on what they return."""

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import (
    aot,
    aot_programs,
    comms,
    lm_costs,
    lm_experts,
    lm_lab,
    lm_layouts,
    moe,
    transformer,
)
from course_lib.tokens import CopyWalk

CFG = transformer.TINY
ONCE = {"xla_backend_optimization_level": 0}


def test_model_of_names_the_model_a_layout_trains():
    assert lm_lab.model_of("ep_dp") == "moe"
    assert {lm_lab.model_of(k) for k in lm_layouts.DENSE_KEYS} == {"dense"}
    with pytest.raises(KeyError):
        lm_lab.model_of("nope")


def test_worst_diff_absolute_and_relative():
    a = {"x": np.array([1.0, 2.0]), "y": np.array([[10.0]])}
    b = {"x": np.array([1.5, 2.0]), "y": np.array([[20.0]])}
    assert lm_lab.worst_diff(a, b) == 10.0
    assert lm_lab.worst_diff(a, b, relative=True) == pytest.approx(0.5)  # 10 / 20 beats 0.5 / 2
    zeros = {"x": np.zeros(2), "y": np.zeros((1, 1))}
    assert lm_lab.worst_diff(zeros, zeros, relative=True) == 0.0  # a leaf of zeros divides by 1
    with pytest.raises(ValueError, match="leaves"):
        lm_lab.worst_diff(a, {"x": a["x"]})


def test_run_parity_matches_the_one_device_reference(report):
    """The data-parallel layout against the reference over two float32 steps: the same losses, gradients
    within float32 rounding; every field the notebook reads is there."""
    task = CopyWalk(CFG.vocab, CFG.seq_len)
    batches = [task.batch(jax.random.key(1 + i), 16) for i in range(2)]
    params = transformer.init_model(jax.random.key(0), CFG)[1]
    models = {"dense": (params, lm_layouts.reference_step(CFG))}
    with ThreadPoolExecutor(2) as pool:
        refs, runs = lm_lab.run_parity(
            ["dp"],
            models,
            batches,
            CFG,
            report.devices,
            jnp.float32,
            pool=pool,
            compiler_options=ONCE,
        )
    assert set(refs) == {"dense"} and len(refs["dense"]) == 2 and set(runs) == {"dp"}
    run = runs["dp"]
    assert set(run) == {"built", "compiled", "worst", "rel", "compile_s", "run_s", "losses"}
    assert run["rel"] < 1e-5 and run["worst"] < 1e-4 and len(run["losses"]) == 2
    assert np.allclose(run["losses"], [loss for loss, _ in refs["dense"]], rtol=1e-5)
    assert run["compile_s"] > 0 and run["run_s"] > 0
    # the results table's row: bytes from the transfers, memory from the program, no MFU without a peak
    sizes = run["built"].sizes
    predicted = lm_costs.predict_bytes("dp", CFG, 16, sizes, itemsize=4)
    measured = comms.collectives(run["compiled"].as_text(), sizes)
    row = lm_lab.results_row("dp", run, {"worst": float("nan")}, predicted, measured,
                             len(report.devices), 1e6, None, "cpu")  # fmt: skip
    assert row["predicted_bytes"] == comms.total_sent(predicted) and row["collectives"] == len(
        measured
    )
    assert row["temp_bytes"] == run["compiled"].memory_analysis().temp_size_in_bytes
    assert (
        np.isnan(row["mfu"])
        and np.isnan(row["parity_f64"])
        and row["final_loss"] == run["losses"][-1]
    )
    with pytest.raises(KeyError):
        lm_lab.results_row("dp", run, {}, predicted, measured, 1, 1e6, None, "cpu")
    with pytest.raises(KeyError):  # ep_dp needs the "moe" model
        lm_lab.run_parity(["ep_dp"], models, batches, CFG, report.devices, jnp.float32, pool=None)


def test_program_facts_from_the_committed_tpu_programs():
    tpu = aot.tpu_summaries(
        (n for n in aot_programs.PROGRAMS if n.startswith("lab12.")), live=False
    )
    facts = lm_lab.program_facts(tpu)
    assert list(facts.columns) == ["XLA:TPU"]
    t = facts["XLA:TPU"]
    # the pipeline's start/done sends and the gathers XLA:TPU writes as asynchronous collective fusions
    assert (
        t["programs with asynchronous collectives"]
        == "3d,dp_cp,fsdp_tp,pp_dp,tp_sp,tp_sp_partitioner"
    )
    assert t["pp_dp: of them asynchronous"] == t["pp_dp: collective-permutes over stage"] > 0
    assert t["ep_dp: all-to-alls over expert"] == 4 * CFG.n_layers
    assert t["ep_dp: of them in bf16 only"] == CFG.n_layers
    assert t["ep_dp: all-to-all dtypes over expert"] == "bf16,f32"
    # the helpers the facts are made of
    dp = tpu["lab12.dp"]
    assert lm_lab.dtypes_of(dp, "all-reduce", ["data"]) == {"f32"}
    assert lm_lab.collectives_of(dp, "all-gather", ["data"]) == []
    assert t["dp: array bytes (not sent)"] == 4 * transformer.param_count(CFG) + 4
    with pytest.raises(ValueError, match="lab12.ep_dp"):
        lm_lab.program_facts({k: v for k, v in tpu.items() if k != "lab12.ep_dp"})


def test_xla_cpu_summaries_name_the_programs_as_the_reference_does(report):
    f = jax.jit(lambda x: x * 2)
    compiled = f.lower(jnp.ones(4)).compile()
    mesh = jax.make_mesh((1,), ("data",), devices=report.devices[:1])
    (name,) = lm_lab.xla_cpu_summaries({"dp": (compiled, mesh)})
    assert name == "lab12.dp"


def test_decision_table_one_row_per_case_overlap_and_remat():
    h100 = lm_costs.FABRICS["H100"]
    table = lm_lab.decision_table(transformer.GPU, h100, {"large batch": (64, 80e9)})
    assert len(table) == len(lm_costs.OVERLAPS) * 2
    assert list(table.columns) == ["case", "overlap", "remat", "winner", "margin", "top", "fits"]
    assert (table["margin"] >= 0).all()
    ranked = lm_costs.rank_layouts(transformer.GPU, 64, h100, 8, memory_limit=80e9)
    row = table[(table["overlap"] == "none") & ~table["remat"]].iloc[0]
    assert row["winner"] == ranked[0]["layout"]
    assert row["margin"] == pytest.approx(ranked[1]["step_s"] / ranked[0]["step_s"] - 1)
    with pytest.raises(ValueError, match="empty"):
        lm_lab.decision_table(transformer.GPU, h100, {})
    with pytest.raises(ValueError, match="memory limit"):
        lm_lab.decision_table(transformer.GPU, h100, {"none fit": (64, 1e6)})


def test_expert_capacity_and_the_all_to_alls_it_sends():
    """The GPU config at batch 64 on data=4 x expert=2: 2.5 MLPs per token at capacity factor 1.25, and
    lm_experts.predict_bytes' all-to-alls are 4 per layer of E x C x D bfloat16 values, each device sending
    (n_e - 1)/n_e of them (the check notebook 12's ep_dp cell made before this test held it)."""
    cfg, sizes = transformer.GPU, {"data": 4, "expert": 2}
    buf = lm_lab.expert_capacity(cfg, 64, sizes, capacity_factor=1.25)
    n_tok = 64 // 8 * cfg.seq_len
    cap = moe.capacity(n_tok, lm_experts.N_EXPERTS, lm_experts.TOP_K, 1.25)
    assert buf == {
        "tokens": n_tok,
        "capacity": cap,
        "places": lm_experts.N_EXPERTS * cap,
        "places_per_token": 2.5,
    }
    a2a = 4 * cfg.n_layers * lm_experts.N_EXPERTS * cap * cfg.d_model * 2 * (2 - 1) / 2
    sent = comms.sent_by_axis(
        lm_experts.predict_bytes(cfg, 64, sizes, itemsize=2, capacity_factor=1.25)
    )
    assert comms.same_bytes(sent["expert"], a2a), (sent, a2a)
    with pytest.raises(ValueError, match="data and expert"):
        lm_lab.expert_capacity(cfg, 64, {"data": 8}, 1.25)
    with pytest.raises(ValueError, match="not a multiple"):
        lm_lab.expert_capacity(cfg, 12, sizes, 1.25)


def test_step_table_in_ms_and_gb():
    row = lm_costs.step_time("dp", transformer.GPU, 64, lm_costs.FABRICS["H100"], 8)
    table = lm_lab.step_table([row])
    assert table.loc[0, "layout"] == "dp"
    assert table.loc[0, "step_ms"] == pytest.approx(row["step_s"] * 1e3, abs=0.01)
    assert table.loc[0, "comm_ms"] == pytest.approx(sum(row["comm_s"].values()) * 1e3, abs=0.01)
    assert {"compute_ms", "sent_GB", "memory_GB"} <= set(table.columns)


def test_model_table_one_row_per_profile_and_layout():
    rows = lm_costs.rank_layouts(transformer.GPU, 64, lm_costs.FABRICS["H100"], 8)
    table = lm_lab.model_table({"H100": rows, "H200": rows[:1]})
    assert len(table) == len(rows) + 1 and all(r["is_model"] for r in table)
    assert table[0]["profile"] == "H100" and table[-1]["profile"] == "H200"
    assert table[0]["comm_s"] == pytest.approx(sum(rows[0]["comm_s"].values()))
    with pytest.raises(KeyError):
        lm_lab.model_table({"H100": [{"layout": "dp"}]})


def test_gathered_weights_are_the_all_gathers_of_a_parameters_shape():
    from course_lib.comms import Collective

    params = {"embed": np.zeros((16, 32)), "blocks": {"w": np.zeros((2, 32, 64))}}

    def gather(kind, *dims):
        return Collective(kind, ("model",), 2, tuple(("f32", d) for d in dims), 0, 0.0, "c")

    weight, block, act = (
        gather("all-gather", (16, 32)),
        gather("all-gather", (32, 64)),
        gather("all-gather", (4, 32)),
    )
    reduce = gather("all-reduce", (16, 32))
    assert lm_lab.gathered_weights([weight, block, act, reduce], params) == [weight, block]


def test_bytes_by_axis_sets_prediction_beside_program():
    sizes = {"data": 8}
    predicted = lm_costs.predict_bytes("dp", CFG, 16, sizes, itemsize=4)
    same = lm_lab.bytes_by_axis("dp", predicted, predicted)
    assert list(same["axis"]) == ["data"] and same["match"].all()
    assert same.loc[0, "predicted"] == comms.sent_by_axis(predicted)["data"] > 0
    none = lm_lab.bytes_by_axis("dp", predicted, [])
    assert none.loc[0, "measured"] == 0.0 and not none["match"].any()
    one = lm_costs.predict_bytes("dp", CFG, 16, {"data": 1}, itemsize=4)
    assert lm_lab.nonzero_by_axis(one) == {}  # an axis of size 1 sends nothing


def test_memory_row_sets_prediction_beside_memory_analysis():
    from types import SimpleNamespace

    pm = lm_costs.predict_memory("dp", CFG, 16, {"data": 8}, 4)
    ma = SimpleNamespace(
        argument_size_in_bytes=pm["arguments"],
        output_size_in_bytes=pm["outputs"],
        temp_size_in_bytes=2 * pm["activations"],
    )
    row = lm_lab.memory_row("dp", pm, ma, 8)
    assert row["arguments_predicted"] == row["argument_size"] and row["temp / est."] == 2.0
    assert row["layout"] == "dp" and row["n_devices"] == 8
