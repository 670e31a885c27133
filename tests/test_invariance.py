"""The invariance matrix: every notebook under papermill at 1, 2 and 4 devices (nbmake runs each as committed,
at 8, in the same ``pytest`` run), and the results that must not depend on the device count compared across
1, 2, 4 and 8.

Each notebook's own asserts are the check of its run (a failing cell fails the test with the notebook and
the cell named). At 8 devices the comparisons read the lab's tiny profile (run here under papermill: the lab
as committed runs its larger default profile) and nbmake's own run of notebook 09. The runs are shared
(``tests/matrix.py``): the lab's tiny runs are also the scaling study, its run at 2 devices is ``make
course``'s test, notebook 09's multi-process losses come from its own runs.
Tolerances: float32 on CPU, reductions summed in another order when the work is split another way:
``rtol=1e-5`` on losses (the lab's own parity tolerance; measured differences are ≤ 2e-7); random draws and
placed parameters are compared exactly.
"""

import json
import os
import tomllib
from pathlib import Path

import matrix
import numpy as np
import pandas as pd
import pytest

from course_lib import config, lab, strategies
from course_tools import results, study

COUNTS, COMPARED = matrix.COUNTS, matrix.COMPARED
LOSS_RTOL = 1e-5
REFERENCE = COMPARED[0]


def _runs():
    for n in COUNTS:
        group = pytest.mark.xdist_group(f"matrix-n{n}")
        for stem in matrix.NOTEBOOKS:
            yield pytest.param(stem, n, id=f"{stem}-n{n}", marks=group)


@pytest.mark.notebook
@pytest.mark.parametrize("stem, n", list(_runs()))
def test_notebook_runs(stem, n):
    folder = matrix.notebook_run(stem, n)
    nb = json.loads((folder / f"{stem}.ipynb").read_text())
    statuses = {
        c["metadata"]["papermill"]["status"] for c in nb["cells"] if c["cell_type"] == "code"
    }
    assert statuses == {"completed"}, statuses


@pytest.mark.notebook
@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.xdist_group(f"matrix-n{n}")) for n in COMPARED]
)
def test_lab_results_at_every_count(n):
    out = matrix.lab_results(n)
    res = pd.read_csv(out / results.RESULTS_FILE)
    assert set(results.RESULT_COLUMNS) <= set(res.columns)
    ran, steps = list(res["strategy"]), config.PROFILES["tiny"].steps
    assert "jit" in ran and set(ran) <= set(strategies.REGISTRY) and len(set(ran)) == len(ran)
    assert (
        res.loc[res.strategy != "jit", "n_devices"].eq(n).all() and (res["profile"] == "tiny").all()
    )
    assert (res["steps"] == steps).all() and (res["samples_per_s"] > 0).all()
    assert (res["bytes_per_device"] > 0).all()
    curves = pd.read_csv(out / results.CURVES_FILE)
    assert len(curves) == len(ran) * steps and set(curves.columns) == {"strategy", "step", "loss"}
    for png in ("loss_curves.png", "comparison.png"):
        assert (out / png).stat().st_size > 10_000
    if n == 2:  # the course run's lab sweeps 1 and 2 devices; the others run without the sweep
        scaling = pd.read_csv(out / results.SCALING_FILE)
        assert sorted(scaling["n_devices"].unique()) == [1, 2]
        assert set(scaling["strategy"]) <= set(lab.SCALING_STRATEGIES) and len(scaling) > 0
        assert (out / "scaling.png").stat().st_size > 10_000
    else:
        assert not (out / results.SCALING_FILE).exists()


# --- what must not depend on the device count ---------------------------------------------------------

compare = pytest.mark.xdist_group("matrix-compare")


def _curves() -> dict[int, pd.DataFrame]:
    return {n: pd.read_csv(matrix.lab_results(n) / results.CURVES_FILE) for n in COMPARED}


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
    rows = {n: pd.read_csv(matrix.lab_results(n) / results.RESULTS_FILE) for n in COMPARED}
    fixed = ["strategy", "global_batch", "image_size", "steps"]
    for n, r in rows.items():
        pd.testing.assert_frame_equal(
            r[fixed], rows[REFERENCE][fixed], obj=f"lab_results at {n} devices"
        )


@compare
@pytest.mark.notebook
def test_multiprocess_losses_do_not_depend_on_the_layout():
    # Notebook 09 splits the devices over processes (1 x 1, 2 x 1, 2 x 2, 2 x 4 at 1, 2, 4, 8) on the tiny
    # profile's data and parameters: the lab's own losses for the same strategies. At 8: nbmake's run.
    curves = _curves()[REFERENCE]
    for n in COMPARED:
        runs = matrix.multihost_outputs(n)
        assert runs, f"no multi-process output at {n} devices"
        for key, got in (kv for r in runs for kv in r["strategies"].items()):
            expected = (
                curves[curves.strategy == key]
                .sort_values("step")["loss"]
                .to_numpy()[: len(got["losses"])]
            )
            assert len(expected) == len(got["losses"]), (key, n)
            np.testing.assert_allclose(
                got["losses"], expected, rtol=LOSS_RTOL, err_msg=f"{key}, {n} devices"
            )


def test_the_default_run_executes_every_notebook_as_committed():
    # The contract: `pytest` (make test, CI) runs every notebook through nbmake, untouched, besides the
    # matrix's papermill runs; the matrix covers every notebook the course runner knows.
    root = Path(__file__).resolve().parents[1]
    ini = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--nbmake" in ini["addopts"].split() and "notebooks" in ini["testpaths"]
    assert sorted(matrix.NOTEBOOKS) == sorted(p.stem for p in (root / "notebooks").glob("*.ipynb"))


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
        # images: the same bits through float math compiled per shard shape, a few ulp apart on some CPUs
        # (tests/test_data.py FLOAT_ATOL); labels (integers) and placed parameters (copies): exact
        np.testing.assert_allclose(
            np.asarray(images), ref_images, rtol=0, atol=1e-6, err_msg=f"{n} shards"
        )
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
    folders = [matrix.lab_results(n) for n in COMPARED]
    rows = study.aggregate(folders)
    table = study.efficiency(rows)
    assert sorted(table["n_devices"].unique()) == sorted(COMPARED)
    one = table[table.n_devices == min(COMPARED)]
    if min(COMPARED) == 1:
        assert one["efficiency"].tolist() == pytest.approx(
            [1.0] * len(one)
        )  # by definition at 1 device
    assert (table["efficiency"] > 0).all() and (table["samples_per_s"] > 0).all()


def _outputs(nb: dict) -> list[dict]:
    """Every output of an executed notebook's code cells, in order."""
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]


def _printed(outputs: list[dict]) -> str:
    """The text those outputs printed (stdout and stderr streams), joined."""
    return "".join("".join(o.get("text", "")) for o in outputs)


@pytest.mark.xdist_group("matrix-n1")
@pytest.mark.notebook
@pytest.mark.skipif(1 not in COUNTS, reason="the preset backend is tried at 1 device")
def test_plots_show_inline_with_a_non_inline_backend_preset():
    folder = matrix.notebook_run(matrix.LAB, 1)  # run with MPLBACKEND=Agg in its environment
    assert matrix.PRESET_ENV[1] == {"MPLBACKEND": "Agg"}
    nb = json.loads((folder / "08_lab.ipynb").read_text())
    outputs = _outputs(nb)
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images >= 2, images  # the loss curves and the comparison, inline
    printed = _printed(outputs)
    assert "MPLBACKEND='Agg' from the environment replaced by the inline backend" in printed
    for png in ("loss_curves.png", "comparison.png"):  # and as files
        assert (folder / "lab" / png).stat().st_size > 10_000


@pytest.mark.notebook
@pytest.mark.xdist_group(f"matrix-n{COUNTS[-1]}")
def test_the_runs_share_one_compilation_cache_but_the_lessons_that_time_compiles():
    # The setup cell prints the persistent cache as a note (course_lib.environment): every run uses the
    # session's cache but the lessons that assert on compile times, which switch it off; it holds programs.
    n = COUNTS[-1]
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])  # the root conftest's
    for stem in matrix.NOTEBOOKS:
        nb = json.loads((matrix.notebook_run(stem, n) / f"{stem}.ipynb").read_text())
        printed = _printed(_outputs(nb))
        off = f"JAX_COMPILATION_CACHE_DIR={cache}: switched off in this kernel" in printed
        used = f"JAX_COMPILATION_CACHE_DIR={cache}: compile times measured here include" in printed
        assert (off, used) == ((True, False) if stem in matrix.TIMES_COMPILES else (False, True)), (
            stem
        )
    assert len(list(cache.glob("*-cache"))) > 100
