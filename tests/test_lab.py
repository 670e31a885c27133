"""The lab's runs: one measured run per strategy, the scaling sweep, the divisibility check."""

import types

import jax
import pytest

from course_lib import config, lab, model
from course_tools import results


def test_run_strategy_row_has_the_contract_columns(report):
    cfg = config.resolve_profile("tiny", "cpu")
    run = lab.run_strategy("sharded_jit", report.devices[:2], cfg, report=report, progress=False)
    assert set(results.RESULT_COLUMNS) <= set(run.row)
    assert (
        run.row["n_devices"] == 2 and run.row["mesh"] == "data=2" and run.row["steps"] == cfg.steps
    )
    assert len(run.losses) == cfg.steps and len(run.step_times_s) == cfg.steps
    assert run.row["samples_per_s"] == pytest.approx(cfg.global_batch / run.row["step_time_s"])
    assert run.row["flops_per_step"] > 0 and "all-reduce" in run.row["collectives"]
    assert run.row["platform"] == "cpu" and run.row["jax_version"] == jax.__version__


def test_scaling_sweep_skips_indivisible_counts(report, capsys):
    cfg = config.resolve_profile("tiny", "cpu", global_batch=6)
    rows = lab.scaling_sweep(
        report.devices[:4], cfg, keys=("sharded_jit",), counts=[1, 2, 4], progress=False
    )
    assert [r["n_devices"] for r in rows] == [1, 2]
    assert "global batch 6 is not divisible by 4 data shards" in capsys.readouterr().out


def test_check_divisibility_names_strategy_and_numbers():
    cfg = config.resolve_profile("tiny", "cpu", global_batch=9)
    with pytest.raises(
        ValueError, match="strategy 'pmap' on 2 devices: global batch 9 is not divisible by 2"
    ):
        lab.check_divisibility(cfg, 2)
    lab.check_divisibility(config.resolve_profile("tiny", "cpu"), 8)


def test_run_strategy_sizes_memory_and_communication(report):
    cfg = config.resolve_profile("tiny", "cpu")
    run = lab.run_strategy("fsdp", report.devices, cfg, report=report, progress=False)
    row = run.row
    assert row["collective_bytes_per_device"] == pytest.approx(row["collective_bytes_predicted"])
    assert row["collective_bytes_by_axis"].startswith("data:")
    assert (
        row["opt_state_bytes_per_device"] == row["param_bytes_per_device"] < 6760
    )  # sharded over 8
    assert (
        row["activation_bytes_per_device"] > 0
        and row["temp_bytes_per_device"] > row["activation_bytes_per_device"]
    )
    assert row["precision"] == "float32" and row["matmul_precision"] == "default"
    assert (
        row["peak_device_bytes"] is None
    )  # CPU: no allocator statistics, never another run's peak
    assert row["mfu"] != row["mfu"] and row["hfu"] != row["hfu"]  # NaN: no peak FLOP/s for a CPU
    # MFU's numerator: the work the step needs, never above what the compiled program runs (MFU <= HFU)
    from course_lib import costs

    assert row["model_flops_per_step"] == costs.model_flops_per_step(cfg.model, cfg.global_batch)
    assert row["model_flops_per_step"] <= row["flops_per_step"]
    assert row["model_flops_per_step"] < 3 * cfg.global_batch * model.flops_per_example(cfg.model)
    # the reduced gradients the update reads are laid out as the parameters: 1/8 of each sharded leaf
    assert row["grad_bytes_per_device"] == row["param_bytes_per_device"]
    assert run.states is None and len(run.batches) == cfg.steps


@pytest.mark.parametrize(
    "key, profile",
    [
        ("jit", "cpu"),
        ("pmap", "tiny"),
        ("shard_map", "cpu"),
        ("sharded_jit", "tiny"),
        ("fsdp_jit", "cpu"),
        ("shard_map_article", "tiny"),
    ],
)
def test_model_flops_never_exceed_the_compiled_programs(report, key, profile):
    cfg = config.resolve_profile(profile, "cpu", steps=3)
    row = lab.run_strategy(key, report.devices, cfg, report=report, progress=False).row
    assert row["model_flops_per_step"] <= row["flops_per_step"]
    # a layout that duplicates no work runs little more than the model's count (bias adds, ReLUs, pools,
    # the loss and the optimizer: 2 % at the cpu profile, 11-13 % on the tiny model)
    if key != "shard_map_article":
        assert row["flops_per_step"] < 1.2 * row["model_flops_per_step"]
    assert row["grad_bytes_per_device"] == row["param_bytes_per_device"]


def test_run_strategy_keeps_states_and_takes_a_perturbation(report):
    from course_lib import parity

    cfg = config.resolve_profile("tiny", "cpu")
    a = lab.run_strategy("jit", report.devices, cfg, keep_states=True, progress=False)
    assert len(a.states) == cfg.steps + 1
    nudged = lab.run_strategy("jit", report.devices, cfg, perturb=parity.nudge, progress=False)
    assert nudged.losses != a.losses
    with pytest.raises(ValueError, match="precision='half'"):
        lab.run_strategy("jit", report.devices, cfg, precision="half", progress=False)


def test_lab_notebook_has_marked_exercises():
    from pathlib import Path

    import nbformat

    from course_tools.student import student_notebook

    path = Path(__file__).resolve().parents[1] / "notebooks" / "08_lab.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    solutions = [i for i, c in enumerate(code) if "# BEGIN SOLUTION" in c.source]
    checks = {i + 1 for i in solutions if i + 1 < len(code)}
    assert len(checks) >= 2
    for i in checks:
        assert (
            "exercise-check" in code[i].metadata.get("tags", [])
            and "lesson08.check_" in code[i].source
        )
    student, replaced = student_notebook(nb, "08_lab")
    blocks = sum(c.source.count("# BEGIN SOLUTION") for c in code)
    assert replaced == blocks and "BEGIN SOLUTION" not in "".join(c.source for c in student.cells)
    project = next(c.source for c in code if "def zero2_step" in c.source)
    body = project.split("# BEGIN SOLUTION")[1].split("# END SOLUTION")[0]
    assert (
        len([line for line in body.splitlines() if line.strip()]) >= 15
    )  # a whole strategy to write


def test_lower_strategy_gives_the_program_without_training(report):
    cfg = config.resolve_profile("tiny", "cpu")
    graphdef, params = model.init_model(jax.random.key(0), cfg.model)
    for key in ("pmap", "sharded_jit"):
        lowered = lab.lower_strategy(
            key, report.devices[:2], cfg, graphdef=graphdef, params=params, global_batch=2
        )
        assert "all-reduce" in lowered.compile().as_text()
    lowered = lab.lower_strategy("jit", report.devices[:1], cfg, precision="float64")
    assert "f64" in lowered.as_text(dialect="hlo")
    with pytest.raises(ValueError, match="global batch 3 is not divisible by 2"):
        lab.lower_strategy("pmap", report.devices[:2], cfg, global_batch=3)


def test_fit_global_batch_keeps_the_cpu_profile_and_halves_on_a_small_chip(
    report, monkeypatch, capsys
):
    from course_lib import sizing

    gpu = config.resolve_profile("auto", "tpu")  # the article's setting: batch 512
    unchanged, tried = sizing.fit_global_batch(gpu, report.devices, "bfloat16", simulated=True)
    assert unchanged is gpu and tried == []  # simulated CPU devices: nothing to fit
    gib = 2**30
    need = {512: 20 * gib, 256: 13 * gib, 128: 6 * gib}  # a 16 GiB chip, 12 GiB budget

    def fake(cfg, devices, precision, batch):
        return sizing.Estimate(batch, need[batch] // 4, need[batch] - need[batch] // 4, 12 * gib)

    monkeypatch.setattr(sizing, "estimate", fake)
    fitted, tried = sizing.fit_global_batch(
        gpu, report.devices[:1], "bfloat16", simulated=False, chip="TPU v5 lite"
    )
    assert fitted.global_batch == 128 and [e.global_batch for e in tried] == [512, 256, 128]
    assert [e.fits for e in tried] == [False, False, True]
    out = capsys.readouterr().out
    assert "TPU v5 lite: global batch 512: 20.00 GiB" in out and "> budget 12.00 GiB" in out
    need[128] = 13 * gib  # nothing fits: the error names the estimate and the fix
    need[64] = need[32] = need[16] = need[8] = need[4] = need[2] = need[1] = 13 * gib
    with pytest.raises(ValueError, match=r"no global batch from 512 down to 1 fits .*fewer steps"):
        sizing.fit_global_batch(gpu, report.devices[:1], "bfloat16", simulated=False)


def test_memory_estimate_parts(report):
    from course_lib import sizing

    gpu = config.resolve_profile("auto", "tpu")
    # the batches one run keeps while it trains; bfloat16 keeps float32 batches (and master weights)
    one_image = 128 * 128 * 3 * 4 + 4
    assert sizing.kept_batch_bytes(gpu, 128, "bfloat16") == gpu.steps * 128 * one_image
    assert sizing.kept_batch_bytes(gpu, 128, "float32") == gpu.steps * 128 * one_image
    f64_image = 128 * 128 * 3 * 8 + 4
    assert sizing.kept_batch_bytes(gpu, 128, "float64") == gpu.steps * 128 * f64_image
    lowered = lab.lower_strategy("jit", report.devices[:1], config.resolve_profile("tiny", "cpu"))
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    assert sizing.program_bytes(compiled) == (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    assert sizing.program_bytes(compiled) > m.argument_size_in_bytes > 0
    with pytest.raises(ValueError, match="reports no memory_stats"):
        sizing.estimate(gpu, report.devices[:1], "float32", 64)


def test_float64_is_refused_on_a_tpu_before_anything_compiles():
    # the devices' platform decides: on one TPU v5e (JAX 0.10.2) the float64 max-pool gradient
    # (select-and-scatter) was observed not to compile
    cfg = config.resolve_profile("tiny", "cpu")
    tpu = [types.SimpleNamespace(platform="tpu")]
    for run in (lab.run_strategy, lab.lower_strategy):
        with pytest.raises(ValueError, match="does not run on XLA:TPU"):
            run("jit", tpu, cfg, precision="float64")


def test_repeat_steps_feeds_each_donated_state_back(report):
    cfg = config.resolve_profile("tiny", "cpu")
    a = lab.run_strategy("jit", report.devices, cfg, keep_states=True, progress=False)
    twice = lab.repeat_steps(a, a.states[0], a.batches[0], calls=2)
    first, second = float(twice()["loss"]), float(twice()["loss"])  # steps 2 and 4 from states[0]
    assert first != second  # the second call continues from the first's state
    once = lab.repeat_steps(a, a.states[0], a.batches[0])
    assert float(once()["loss"]) == pytest.approx(a.losses[0], rel=1e-5)  # step 1's loss: A's first
    with pytest.raises(ValueError, match="calls=0"):
        lab.repeat_steps(a, a.states[0], a.batches[0], calls=0)
