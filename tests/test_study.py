"""Scaling-study aggregation: comparable runs only."""

import pytest

from course_tools import results, study


def fake_run(folder, n, **over):
    row = {c: 0 for c in results.RESULT_COLUMNS}
    base = dict(
        profile="cpu",
        platform="cpu",
        device_kind="cpu",
        jax_version="0.12.0.1",
        global_batch=64,
        image_size=32,
    )
    base.update(over)
    rows = []
    for key in ("jit", "pmap"):
        r = dict(
            row,
            **base,
            strategy=key,
            n_devices=1 if key == "jit" else n,
            samples_per_s=100.0 * (n if key == "pmap" else 1) ** 0.5,
            step_time_s=0.1,
            bytes_per_device=1000 // n,
        )
        rows.append(r)
    folder.mkdir()
    results.write_csv(rows, folder / results.RESULTS_FILE)
    return folder


def test_aggregate_and_efficiency(tmp_path):
    dirs = [fake_run(tmp_path / f"n{n}", n) for n in (1, 2, 4)]
    rows = study.aggregate(dirs)
    assert list(rows["run"].unique()) == ["n1", "n2", "n4"]
    eff = study.efficiency(rows)
    assert list(eff["strategy"].unique()) == ["pmap"]
    assert eff["efficiency"].tolist() == pytest.approx([1.0, 2**0.5 / 2, 0.5])
    fig = study.plot_study(eff, reference=eff, simulated=True)
    assert len(fig.axes) == 4 and "relative" in fig.axes[0].get_title()


@pytest.mark.parametrize(
    "col, value", [("profile", "gpu"), ("platform", "gpu"), ("jax_version", "0.11.0")]
)
def test_incomparable_runs_are_refused(tmp_path, col, value):
    dirs = [fake_run(tmp_path / "n1", 1), fake_run(tmp_path / "n2", 2, **{col: value})]
    with pytest.raises(study.IncomparableRuns, match=f"runs differ in '{col}'"):
        study.aggregate(dirs)


def test_missing_run_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        study.aggregate([tmp_path])


def test_runs_of_different_commits_are_named(tmp_path, capsys):
    import json

    from course_tools import folders

    dirs = []
    for name, commit in (("lab", "a" * 40), ("lab-2", "b" * 40)):
        d = tmp_path / name
        d.mkdir()
        (d / folders.CLAIM_FILE).write_text(
            json.dumps({"started": "2026-05-01T10:00:00", "commit": commit})
        )
        dirs.append(d)
    assert study.commit_notes(dirs) == [
        "the runs are of different commits of the course: {'lab': 'aaaaaaa', 'lab-2': 'bbbbbbb'}"
    ]
    assert study.commit_notes(dirs[:1]) == [] and study.commit_notes([tmp_path / "none"]) == []
