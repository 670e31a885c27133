"""course_tools.run: the lab run end to end with papermill (as a batch study would), at 1, 2 and 8
devices, tiny profile; the course run of 00 and 08, rendered as a site and checked in a real
headless browser (Chromium).
"""

import os
import re
import shutil
import subprocess

import matplotlib.image as mpimg
import pandas as pd
import pytest

from course_tools import results, run, site


@pytest.fixture(scope="module")
def course_run(tmp_path_factory):
    """The 2-device papermill run: 00_setup and the lab (tiny, with the scaling sweep) as ``make course``
    runs them; the site tests below render the same folder."""
    tmp = tmp_path_factory.mktemp("course")
    return run.run_course(
        2,
        platform="cpu",
        build=str(tmp),
        only=["00", "08"],
        progress=False,
        lab_params={"profile": "tiny", "scaling": True},
    )


def test_course_run_writes_a_time_table(course_run):
    timings = pd.read_csv(course_run / "timings.csv")
    assert (
        list(timings["notebook"]) == ["00_setup.ipynb", "08_lab.ipynb"]
        and (timings["status"] == "ok").all()
    )
    assert (course_run / "00_setup.ipynb").exists()


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    """The scaling study at 1 and 8 devices: two papermill runs of the lab (separate kernels), aggregated."""
    tmp = tmp_path_factory.mktemp("scaling")
    return run.run_scaling(
        ["1", "8"], platform="cpu", profile="tiny", build=str(tmp), progress=False
    )


def test_scaling_study_aggregates_the_runs(scaling_run):
    assert sorted(p.name for p in scaling_run.iterdir() if p.is_dir()) == ["n1", "n8"]
    table = pd.read_csv(scaling_run / "study.csv")
    assert set(table["strategy"]) == {"pmap", "shard_map", "sharded_jit", "shard_map_article"}
    assert sorted(table["n_devices"].unique()) == [1, 8]
    one = table[table.n_devices == 1]
    assert one["efficiency"].tolist() == pytest.approx(
        [1.0] * len(one)
    )  # by definition at 1 device
    assert (table["efficiency"] > 0).all() and (scaling_run / "study.png").stat().st_size > 10_000


@pytest.mark.parametrize("n", [1, 2, 8])
def test_lab_with_papermill(n, request):
    # n=1 and 8 come from the scaling study's runs; n=2 from the course run, whose lab also sweeps 1-2 devices.
    # The scaling sweep at 8 devices is exercised by the nbmake run of the notebook.
    if n == 2:
        out = request.getfixturevalue("course_run") / "lab"
    else:
        out = request.getfixturevalue("scaling_run") / f"n{n}"
    res = pd.read_csv(out / results.RESULTS_FILE)
    assert set(results.RESULT_COLUMNS) <= set(res.columns)
    assert list(res["strategy"]) == ["jit", "pmap", "shard_map", "sharded_jit", "shard_map_article"]
    assert (
        res.loc[res.strategy != "jit", "n_devices"].eq(n).all() and (res["profile"] == "tiny").all()
    )
    assert (
        (res["steps"] == 6).all()
        and (res["samples_per_s"] > 0).all()
        and (res["bytes_per_device"] > 0).all()
    )
    curves = pd.read_csv(out / results.CURVES_FILE)
    assert len(curves) == 5 * 6 and set(curves.columns) == {"strategy", "step", "loss"}
    for png in ("loss_curves.png", "comparison.png"):
        assert (out / png).stat().st_size > 10_000
    assert (out / "08_lab.ipynb").exists() or (n == 2 and (out.parent / "08_lab.ipynb").exists())
    if n == 2:
        scaling = pd.read_csv(out / results.SCALING_FILE)
        assert sorted(scaling["n_devices"].unique()) == [1, 2]
        assert set(scaling["strategy"]) == {"pmap", "shard_map", "sharded_jit"}
        assert (out / "scaling.png").stat().st_size > 10_000
    else:
        assert not (out / results.SCALING_FILE).exists()


def test_second_run_goes_to_a_new_folder_and_bad_input_is_refused(tmp_path, capsys):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / results.RESULTS_FILE).write_text("strategy\nmine\n")
    assert run.main(["lab", "--n-devices", "eight", "--build", str(tmp_path)]) == 1
    assert "n_devices='eight' is not an integer" in capsys.readouterr().err
    assert run.main(["lab", "--n-devices", "0", "--build", str(tmp_path)]) == 1
    assert (tmp_path / "lab" / results.RESULTS_FILE).read_text() == "strategy\nmine\n"
    assert not (tmp_path / "lab-2").exists()  # refused before any folder was made


def test_a_failing_lab_names_the_cell(tmp_path):
    with pytest.raises(
        run.NotebookFailed,
        match=r"08_lab.ipynb failed in cell \[\d+\] with ValueError: .*global batch 9",
    ):
        run.run_lab(
            2,
            platform="cpu",
            profile="tiny",
            build=str(tmp_path),
            extra={"global_batch": 9},
            progress=False,
        )


# --- the rendered course, checked in headless Chromium: pages load, links resolve, plots show ---


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(
            "Chromium is needed for the site test: apt-get install chromium (.ci/run installs it)"
        )
    pytest.skip("Chromium not installed (apt-get install chromium); CI runs this test")


def browse(browser, url, tmp, name):
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / ('profile-' + name)}",
    ]
    shot = tmp / f"{name}.png"
    subprocess.run(
        [browser, *flags, "--window-size=1200,1600", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return shot, dom


@pytest.fixture(scope="module")
def rendered(course_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("site")
    return tmp, site.build_site(course_run, tmp / "site")


def test_site_pages_load_with_plots_and_working_links(rendered):
    tmp, pages = rendered
    browser = chromium()
    index = pages[0]
    assert [p.name for p in pages] == ["index.html", "00_setup.html", "08_lab.html"]
    for page in pages:
        html = page.read_text()
        for href in re.findall(r'(?:href|src)="([^"#:]+)"', html):  # relative links and images
            assert (page.parent / href).exists(), f"{page.name}: broken link {href}"
        shot, dom = browse(browser, page.as_uri(), tmp, page.stem)
        img = mpimg.imread(shot)
        assert img.shape[0] >= 1000 and img.shape[1] >= 1000
        assert img[..., :3].std() > 0.02, f"{page.name} rendered blank"
        if page.name == "index.html":
            assert "Parallel programming with JAX" in dom and "Capstone lab" in dom
            assert dom.count("<img") >= 3  # loss curves, comparison, scaling
        if page.name == "08_lab.html":
            assert dom.count("data:image/png;base64") >= 3  # the lab's plots inline
            assert "lab finished in" in dom
    assert "00_setup.html" in index.read_text() and "(not run)" in index.read_text()


def test_site_refuses_to_overwrite(rendered, course_run, tmp_path):
    tmp, pages = rendered
    with pytest.raises(FileExistsError, match="not empty"):
        site.build_site(course_run, pages[0].parent)
    with pytest.raises(FileNotFoundError, match="make course"):
        site.build_site(tmp_path, tmp_path / "out")
