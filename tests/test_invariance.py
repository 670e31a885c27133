"""The invariance matrix: every notebook under papermill at 1, 2, 4 and 8 devices, and the results that must
not depend on the device count compared across counts.

Each notebook's own asserts are the check of its run (a failing cell fails the test with the notebook and
the cell named). At 8 devices every notebook also runs exactly as committed (no parameter injected), which is
what a learner opens. The runs are shared (``tests/matrix.py``): the lab's tiny runs are also the scaling
study, its run at 2 devices is ``make course``'s test, notebook 09's multi-process losses come from its own
runs. Tolerances: float32 on CPU, reductions summed in another order when the work is split another way:
``rtol=1e-5`` on losses (the lab's own parity tolerance; measured differences are ≤ 2e-7); random draws and
placed parameters are compared exactly.
"""

import json

import matrix
import numpy as np
import pandas as pd
import pytest

from course_tools import results, study

COUNTS = matrix.COUNTS
LOSS_RTOL = 1e-5
REFERENCE = COUNTS[0]


def _runs():
    for n in COUNTS:
        group = pytest.mark.xdist_group(f"matrix-n{n}")
        for stem in matrix.NOTEBOOKS:
            yield pytest.param(stem, n, False, id=f"{stem}-n{n}", marks=group)
        if n == matrix.DEFAULTS_COUNT:
            for stem in matrix.NOTEBOOKS:
                yield pytest.param(stem, n, True, id=f"{stem}-as-committed", marks=group)


@pytest.mark.notebook
@pytest.mark.parametrize("stem, n, defaults", list(_runs()))
def test_notebook_runs(stem, n, defaults):
    folder = matrix.notebook_run(stem, n, defaults)
    nb = json.loads((folder / f"{stem}.ipynb").read_text())
    statuses = {
        c["metadata"]["papermill"]["status"] for c in nb["cells"] if c["cell_type"] == "code"
    }
    assert statuses == {"completed"}, statuses


@pytest.mark.notebook
@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.xdist_group(f"matrix-n{n}")) for n in COUNTS]
)
def test_lab_results_at_every_count(n):
    out = matrix.lab_results(n)
    res = pd.read_csv(out / results.RESULTS_FILE)
    assert set(results.RESULT_COLUMNS) <= set(res.columns)
    assert list(res["strategy"]) == ["jit", "pmap", "shard_map", "sharded_jit", "shard_map_article"]
    assert (
        res.loc[res.strategy != "jit", "n_devices"].eq(n).all() and (res["profile"] == "tiny").all()
    )
    assert (res["steps"] == 6).all() and (res["samples_per_s"] > 0).all()
    assert (res["bytes_per_device"] > 0).all()
    curves = pd.read_csv(out / results.CURVES_FILE)
    assert len(curves) == 5 * 6 and set(curves.columns) == {"strategy", "step", "loss"}
    for png in ("loss_curves.png", "comparison.png"):
        assert (out / png).stat().st_size > 10_000
    if n == 2:  # the course run's lab sweeps 1 and 2 devices; the others run without the sweep
        scaling = pd.read_csv(out / results.SCALING_FILE)
        assert sorted(scaling["n_devices"].unique()) == [1, 2]
        assert set(scaling["strategy"]) == {"pmap", "shard_map", "sharded_jit"}
        assert (out / "scaling.png").stat().st_size > 10_000
    else:
        assert not (out / results.SCALING_FILE).exists()


# --- what must not depend on the device count ---------------------------------------------------------

compare = pytest.mark.xdist_group("matrix-compare")


def _curves() -> dict[int, pd.DataFrame]:
    return {n: pd.read_csv(matrix.lab_results(n) / results.CURVES_FILE) for n in COUNTS}


@compare
@pytest.mark.notebook
def test_lab_losses_do_not_depend_on_the_device_count():
    curves = _curves()
    ref = curves[REFERENCE].set_index(["strategy", "step"])["loss"]
    for n, c in curves.items():
        got = c.set_index(["strategy", "step"])["loss"]
        assert got.index.equals(ref.index), (n, sorted(set(got.index) ^ set(ref.index)))
        np.testing.assert_allclose(
            got.to_numpy(), ref.to_numpy(), rtol=LOSS_RTOL, err_msg=f"{n} devices"
        )


@compare
@pytest.mark.notebook
def test_initial_parameters_and_data_do_not_depend_on_the_device_count():
    # The loss before the first update is a function of the initial parameters and the first batch only.
    first = {n: c[c.step == 0].set_index("strategy")["loss"] for n, c in _curves().items()}
    start = first[REFERENCE]["jit"]
    for n, losses in first.items():
        np.testing.assert_allclose(losses.to_numpy(), start, rtol=LOSS_RTOL, err_msg=f"{n} devices")
    rows = {n: pd.read_csv(matrix.lab_results(n) / results.RESULTS_FILE) for n in COUNTS}
    fixed = ["strategy", "global_batch", "image_size", "steps"]
    for n, r in rows.items():
        pd.testing.assert_frame_equal(
            r[fixed], rows[REFERENCE][fixed], obj=f"lab_results at {n} devices"
        )


@compare
@pytest.mark.notebook
def test_multiprocess_losses_do_not_depend_on_the_layout():
    # Notebook 09 splits the devices over processes (1 x 1, 2 x 1, 2 x 2, 2 x 4 at 1, 2, 4, 8) on the tiny
    # profile's data and parameters: the lab's own losses for the same strategies.
    lab = _curves()[REFERENCE]
    for n in COUNTS:
        runs = matrix.multihost_outputs(n)
        assert runs, f"no multi-process output at {n} devices"
        launched = runs[0]["strategies"]
        for key, got in launched.items():
            expected = (
                lab[lab.strategy == key]
                .sort_values("step")["loss"]
                .to_numpy()[: len(got["losses"])]
            )
            np.testing.assert_allclose(
                got["losses"], expected, rtol=LOSS_RTOL, err_msg=f"{key}, {n} devices"
            )


def test_random_draws_and_placed_parameters_are_the_same_on_any_number_of_shards(report):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from course_lib import config as course_config
    from course_lib import strategies
    from course_lib.steps import init_state, make_optimizer

    cfg = course_config.PROFILES["tiny"]
    opt = make_optimizer(cfg.learning_rate)
    start = course_config.init_run(cfg, seed=0)
    ref_images, ref_labels = (
        np.asarray(x) for x in start.dataset.batch(jax.random.fold_in(start.data_key, 0), 32)
    )
    for n in (1, 2, 4, 8):
        mesh = jax.sharding.Mesh(np.array(report.devices[:n]), ("data",))
        images, labels = start.dataset.batch(
            jax.random.fold_in(start.data_key, 0), 32, NamedSharding(mesh, PartitionSpec("data"))
        )
        np.testing.assert_array_equal(np.asarray(images), ref_images, err_msg=f"{n} shards")
        np.testing.assert_array_equal(np.asarray(labels), ref_labels, err_msg=f"{n} shards")
        for key in ("sharded_jit", "shard_map"):
            strat = strategies.build(key, start.graphdef, start.params, opt, report.devices[:n])
            placed = jax.device_get(strat.place_state(init_state(start.params, opt)).params)
            for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(start.params), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{key} at {n}")


# --- shared work: the lab's runs are also the scaling study and the headless-plot check ---------------


@compare
@pytest.mark.notebook
def test_the_labs_runs_are_a_scaling_study():
    folders = [matrix.lab_results(n) for n in COUNTS]
    rows = study.aggregate(folders)
    table = study.efficiency(rows)
    assert sorted(table["n_devices"].unique()) == sorted(COUNTS)
    one = table[table.n_devices == min(COUNTS)]
    if min(COUNTS) == 1:
        assert one["efficiency"].tolist() == pytest.approx(
            [1.0] * len(one)
        )  # by definition at 1 device
    assert (table["efficiency"] > 0).all() and (table["samples_per_s"] > 0).all()


@pytest.mark.xdist_group("matrix-n1")
@pytest.mark.notebook
@pytest.mark.skipif(1 not in COUNTS, reason="the preset backend is tried at 1 device")
def test_plots_show_inline_with_a_non_inline_backend_preset():
    folder = matrix.notebook_run(matrix.LAB, 1)  # run with MPLBACKEND=Agg in its environment
    assert matrix.PRESET_ENV[1] == {"MPLBACKEND": "Agg"}
    nb = json.loads((folder / "08_lab.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images >= 2, images  # the loss curves and the comparison, inline
    printed = "".join("".join(o.get("text", "")) for o in outputs)
    assert "MPLBACKEND='Agg' from the environment replaced by the inline backend" in printed
    for png in ("loss_curves.png", "comparison.png"):  # and as files
        assert (folder / "lab" / png).stat().st_size > 10_000
