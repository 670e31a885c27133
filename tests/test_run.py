"""course_tools.run: the lab run end to end with papermill (as a batch study would), at 1, 2 and 8
devices, tiny profile; the course run of 00 and 08, rendered as a site and checked in a real
headless browser (Chromium).
"""

import re

import book_browser
import pandas as pd
import pytest

from course_tools import results, run, site


@pytest.fixture(scope="module")
def course_run(tmp_path_factory):
    """The 2-device papermill run: 00_setup and the lab (tiny, with the scaling sweep) as ``make course``
    runs them; the book tests below render the same folder."""
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


# --- the course run as a book (Sphinx), checked in headless Chromium: pages load, links resolve, plots show ---


@pytest.fixture(scope="module")
def rendered(course_run, tmp_path_factory):
    """``python -m course_tools.site`` on the 00 + 08 run into a used folder: the book goes to a new one beside it."""
    tmp = tmp_path_factory.mktemp("site")
    (tmp / "site").mkdir()
    (tmp / "site" / "mine.txt").write_text("keep")
    assert (
        site.main([str(course_run), str(tmp / "site"), "--strict"]) == 0
    )  # --strict: any Sphinx warning fails
    assert [p.name for p in (tmp / "site").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp.iterdir()) == [
        "site",
        "site-2",
    ]  # nothing else written beside them
    return tmp / "site-2"


def test_site_book_of_a_course_run_in_the_browser(rendered, course_run, tmp_path):
    book = rendered
    lessons = book_browser.LESSONS
    browser = book_browser.Browser(tmp_path)
    visits = {}
    try:
        with book_browser.serve(book) as base:
            for page in sorted(book.glob("*.html")):
                visits[page.stem] = v = browser.visit(base + page.name)
                book_browser.check_page(v, book, base)
            found = browser.search(base, "shard_map")
    finally:
        browser.close()
    assert set(visits) == {
        "index",
        "genindex",
        "search",
        "lab-report",
        "run",
        "instructor-guide",
        *lessons,
    }
    for stem in (
        lessons
    ):  # every lesson page, executed or not: the whole course in the sidebar, prev / next
        v = visits[stem]
        assert book_browser.sidebar_lessons(v) == lessons, stem
        assert len(v.prev_next) == 2, stem
        assert bool(v.page_toc) == (stem in ("00_setup", "08_lab")), (
            stem
        )  # per-page contents of a lesson
    assert "06_shard_map.html" in found[:3], found
    # executed lessons: the run's outputs and plots; the injected parameters as a note, not as code
    lab, setup = visits["08_lab"], visits["00_setup"]
    assert "lab finished in" in lab.text
    assert (
        sum(i["src"].endswith(".png") for i in lab.images) >= 3
    )  # loss curves, comparison, scaling
    assert "Run with n_devices=2, platform='cpu'" in setup.text and "# Parameters" not in setup.text
    assert "profile='tiny'" in lab.text and "results_dir='course/lab'" in lab.text
    assert "n_devices = 8" in setup.text  # the notebook's own parameters cell stays as code
    assert "https://docs.jax.dev/en/latest/jit-compilation.html" in visits["02_jit"].links
    assert "100%" in lab.text and "0%|" not in lab.text  # tqdm bars as their final text
    # lessons this run did not execute: a page that says so
    for stem in set(lessons) - {"00_setup", "08_lab"}:
        assert "(not in this run)" in visits[stem].text and "make course" in visits[stem].text, stem
    # the lab report: this run's tables and plots, and the reference run beside them, labelled
    report = visits["lab-report"]
    assert (
        "This run" in report.text
        and "Reference run" in report.text
        and "reference_cpu_8sim.csv" in report.text
    )
    res = pd.read_csv(course_run / "lab" / results.RESULTS_FILE)
    for label, ms in zip(res["label"], res["step_time_s"] * 1e3):
        assert label in report.text and f"{ms:.1f}" in report.text
    assert (
        "Not comparable row by row" in report.text
    )  # tiny profile at 2 devices vs the 8-device CPU reference
    shown = [i["src"].rsplit("/", 1)[-1] for i in report.images]
    assert {"loss_curves.png", "comparison.png", "scaling.png"} <= set(shown) and len(
        shown
    ) >= 5  # + reference
    assert "simulated CPU devices" in report.text
    # the run's metadata, as the notebooks reported it
    run_page = visits["run"].text
    assert re.search(r"device count\s+2 used, of 2 available", run_page), run_page[:2000]
    assert (
        re.search(r"simulated\s+yes", run_page)
        and "0.12.0.1" in run_page
        and "timings.csv" in run_page
    )
    home = visits["index"].text
    assert "2 simulated CPU devices" in home and "Not in this run" in home
    for lesson in site.course_map():  # the course map links every lesson's official JAX pages
        assert all(d["url"] in visits["index"].links for d in lesson["jax_docs"]), lesson["stem"]


def test_site_refuses_to_overwrite(rendered, course_run, tmp_path):
    with pytest.raises(FileExistsError, match="not empty"):
        site.build_site(course_run, rendered)
    with pytest.raises(FileNotFoundError, match="make course"):
        site.build_site(tmp_path, tmp_path / "out")
