"""The TPU reference runs the lab report shows beside the CPU reference (course_tools.tpu_reference): the
newest run folder, the newest one with lab results, the tables and figures drawn from a small fixture of
committed files, and what the page says where no lab results are committed."""

import shutil

import jinja2

from course_tools import results, site, tpu_reference


def _tpu_run(root, name, lab=None):
    """A TPU reference folder as tools/tpu_check.sh commits it; ``lab``: where its lab_results.csv goes."""
    folder = root / name
    folder.mkdir()
    (folder / "notebooks.csv").write_text(
        "# recorded by a test\nrun,notebook,ok,seconds,failed_cell,error,peak_bytes_in_use,bytes_limit\n"
        "run 1,01_grad,False,50.0,35,AssertionError: ,1048576,16909336064\n"
        "run 2,01_grad,True,56.9,,,10485760,16909336064\nrun 1,06_shard_map,True,50.9,,,9588736,16909336064\n"
    )
    (folder / "device.txt").write_text(
        "UserWarning: hugepages\nplatform     : tpu (real)\ndevices      : 1 of 1 available (TPU v5 lite)\n"
        "chip         : TPU v5e: 197 TFLOP/s dense bf16\npython       : 3.11.7 on 13 host CPU cores\n"
    )
    (folder / "versions.txt").write_text("jax                       0.10.2\nlibtpu   0.0.42.1\n")
    (folder / "summary.txt").write_text("The course on one TPU v5e chip, a test\nmore\n")
    if lab:
        rows = results.load_reference("cpu").head(2)
        rows = rows.assign(platform="tpu", device_kind="TPU v5 lite", simulated=False, mfu=0.116)
        (folder / lab).mkdir(parents=True)
        rows.to_csv(folder / lab / results.RESULTS_FILE, index=False)
    return folder


def test_the_lab_report_draws_the_newest_tpu_reference_with_lab_results(tmp_path):
    root = tmp_path / "tpu_reference"
    root.mkdir()
    (root / "programs").mkdir()  # not a run folder
    _tpu_run(root, "2026-12-05-tpu-v5-lite-x1", lab="lab")
    bare = _tpu_run(root, "2026-12-06-tpu-v5-lite-x1")
    # as tools/tpu_check.sh writes it: no run column, a lab row, a memory peak not recorded
    (bare / "notebooks.csv").write_text(
        "notebook,ok,seconds,failed_cell,error,peak_bytes_in_use,bytes_limit\n"
        "06_shard_map,True,50.9,,,,\n08_lab_bf16,False,12.0,40,AssertionError: ,,\n"
    )
    assert [r.date for r in tpu_reference.runs(root)] == ["2026-12-06", "2026-12-05"]
    assert tpu_reference.newest(root).folder.name == "2026-12-06-tpu-v5-lite-x1"
    assert tpu_reference.newest(root, with_lab=True).folder.name == "2026-12-05-tpu-v5-lite-x1"
    # a later run of the same day (tools/tpu_check.sh adds -2, -3, … -10): the day's highest number first
    for k in (2, 9, 10):
        _tpu_run(root, f"2026-12-06-tpu-v5-lite-x1-{k}")
    assert tpu_reference.newest(root).folder.name == "2026-12-06-tpu-v5-lite-x1-10"
    names = [r.folder.name for r in tpu_reference.runs(root)][:4]
    assert names == [f"2026-12-06-tpu-v5-lite-x1{k}" for k in ("-10", "-9", "-2", "")]
    for k in (2, 9, 10):
        shutil.rmtree(root / f"2026-12-06-tpu-v5-lite-x1-{k}")
    newer = _tpu_run(root, "2026-12-07-tpu-v5-lite-x8", lab="lab/bf16")
    assert tpu_reference.newest(root, with_lab=True).folder == newer
    assert tpu_reference.newest(root, with_lab=True).count == 8
    staging = tmp_path / "staging"
    staging.mkdir()
    ctx = tpu_reference.context(staging, root)
    assert ctx["versions"] == "JAX 0.10.2, libtpu 0.0.42.1, Python 3.11.7"
    assert ctx["chip"] == "TPU v5e: 197 TFLOP/s dense bf16" and ctx["passed"] == "2 of 2"
    assert ctx["notebooks"]["rows"][0][:3] == ["01_grad", "run 2", "ran clean"]  # its last run
    (lab,) = ctx["labs"]
    assert lab["file"].endswith("2026-12-07-tpu-v5-lite-x8/lab/bf16/lab_results.csv")
    assert "`TPU v5 lite` devices (tpu)" in lab["summary"]
    assert lab["results"][-1]["rows"][0][-1] == "11.6%"  # the MFU column
    assert (staging / lab["figure"]).stat().st_size > 10_000
    assert (staging / ctx["figure"]).stat().st_size > 10_000
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(site.BOOK / "pages"), undefined=jinja2.StrictUndefined
    )
    t = {"headers": ["h"], "rows": [["v"]]}
    ref = {"file": "r.csv", "summary": "s", "results": [t, t], "plots": [], "scaling": None}
    page = lambda tpu: env.get_template("lab-report.md.jinja").render(  # noqa: E731
        run={"folder": "x"}, lab=None, ref=ref, simulated=False, results_file="r.csv", tpu=tpu
    )
    shown = page(ctx)
    assert "### The lab on the TPU" in shown and "lab/bf16/lab_results.csv" in shown
    assert "| 11.6% |" in shown and "No TPU reference committed so far" not in shown
    for folder in (newer, root / "2026-12-05-tpu-v5-lite-x1"):  # no lab results anywhere: said so
        shutil.rmtree(folder)
    alone = tpu_reference.context(tmp_path / "staging", root)
    assert alone["labs"] == [] and alone["lab_folder"] is None and alone["passed"] == "1 of 2"
    assert alone["notebooks"]["rows"][1][:4] == ["08_lab_bf16", "failed", "12.0", "40"]
    assert "No TPU reference committed so far has lab results" in page(alone)
    assert "No TPU reference run is committed" in page(tpu_reference.context(staging, tmp_path))
