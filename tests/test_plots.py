"""Plots draw what they are given."""

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from course_lib import measure, plots  # noqa: E402
from course_tools import results  # noqa: E402


def test_plots_draw_what_they_are_given():
    curves = pd.DataFrame(results.curves_rows({"jit": [3.0, 2.0, 1.0], "pmap": [3.0, 2.0, 1.0]}))
    ax = plots.loss_curves(curves)
    assert len(ax.lines) == 2
    rows = pd.DataFrame(
        [
            {
                "strategy": s,
                "n_devices": n,
                "samples_per_s": 100.0 * n**0.5,
                "step_time_s": 0.1,
                "bytes_per_device": 2**20,
                "achieved_flops_per_s": 1e9,
                "simulated": True,
            }
            for s in ("pmap", "sharded_jit")
            for n in (1, 2, 4)
        ]
    )
    ax = plots.scaling(rows)
    assert len(ax.lines) == 3 and "relative" in ax.get_ylabel()
    eff = measure.scaling_efficiency(rows)
    assert eff.loc[eff.n_devices == 4, "efficiency"].tolist() == pytest.approx([0.5, 0.5])
    fig = plots.comparison(rows[rows.n_devices == 4], reference=rows[rows.n_devices == 1])
    assert len(fig.axes) == 4 and len(fig.axes[0].patches) == 4
    matplotlib.pyplot.close("all")


def test_save_replaces_a_picture_whole_or_leaves_the_old_one(tmp_path, monkeypatch):
    import matplotlib.figure

    from course_lib import plots

    fig = matplotlib.figure.Figure()
    fig.add_subplot().plot([0, 1], [1, 0])
    path = tmp_path / "p.png"
    assert plots.save(fig, path) == str(path)
    first = path.read_bytes()
    assert first.startswith(b"\x89PNG") and oct(path.stat().st_mode & 0o777) == "0o644"

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space"):
        plots.save(fig, path)
    assert path.read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["p.png"]


def test_save_lab_plots_writes_the_lab_pictures(tmp_path):
    table = results.load_reference("cpu")
    curves = pd.DataFrame(results.curves_rows({k: [3.0, 2.0] for k in table["strategy"]}))
    written = plots.save_lab_plots(tmp_path, table, curves, simulated=True)
    names = ["loss_curves.png", "comparison.png", "collective_bytes.png", "memory_by_kind.png"]
    assert [p.split("/")[-1] for p in written] == names
    assert all((tmp_path / n).read_bytes().startswith(b"\x89PNG") for n in names)
    assert not matplotlib.pyplot.get_fignums()  # closed
