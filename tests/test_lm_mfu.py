"""course_lib.lm_mfu at the TINY size on a simulated CPU device, and tools/lm_mfu.py's refusals."""

import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import lm_mfu, transformer

ROOT = Path(__file__).resolve().parents[1]
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7: the spacing of bfloat16 numbers at 1


@pytest.fixture(scope="module")
def runs():
    device = jax.devices()[0]
    return {
        remat: lm_mfu.measure("tiny", 2, device, steps=3, warmup=1, remat=remat)
        for remat in (True, False)
    }


def test_a_tiny_measurement_is_finite_and_claims_no_mfu_on_cpu(runs):
    m = runs[True]
    assert m.config_name == "tiny" and m.config == transformer.TINY and m.batch == 2 and m.remat
    assert m.timing.n == 3 and 0 < m.step_s < 60 and math.isfinite(m.compile_s)
    tokens = 2 * transformer.TINY.seq_len
    assert m.model_flops == 3 * transformer.flops_per_token(transformer.TINY) * tokens
    assert (
        m.hardware_flops > m.model_flops == runs[False].hardware_flops
    )  # remat recomputes the blocks
    # simulated CPU devices: no peak, so no MFU or HFU; no allocator statistics, so no peak bytes
    assert m.platform == "cpu" and m.peak_flops is None and m.mfu is None and m.hfu is None
    assert m.peak_bytes is None and m.own_peak_bytes is None
    assert set(m.memory) == {"argument", "output", "temp", "alias"} and m.need_bytes > 0
    # the parameters are donated: the new ones are written into them (bfloat16, 2 bytes each)
    assert m.memory["alias"] == 2 * transformer.param_count(transformer.TINY)
    assert len(m.losses) == 4 and all(map(math.isfinite, m.losses))
    row = m.row()
    assert tuple(row) == lm_mfu.FIELDS and row["fits"] and row["mfu"] is None
    assert "no MFU (cpu: no peak)" in m.describe()


def test_the_loss_falls_over_a_few_steps(runs):
    for m in runs.values():
        assert m.losses[-1] < 0.75 * m.losses[0], m.losses


def test_remat_gives_the_same_losses_to_bfloat16_rounding(runs):
    # the forward is the same math; the backward recomputes it: within a few bfloat16 roundings
    np.testing.assert_allclose(runs[True].losses, runs[False].losses, rtol=4 * BF16_EPS)
    assert (
        runs[True].memory["temp"] < runs[False].memory["temp"]
    )  # remat keeps less for the backward


def test_remat_costs_the_blocks_forward_once_more_at_the_gpu_size():
    cfg = transformer.GPU
    blocks = transformer.flops_per_token(cfg) - 2 * cfg.d_model * cfg.vocab
    ratio = lm_mfu.hardware_flops(cfg, 1, True) / lm_mfu.model_flops(cfg, 1)
    assert ratio == pytest.approx(1 + blocks / (3 * transformer.flops_per_token(cfg)))
    assert 1.25 < ratio < 4 / 3  # the head is not recomputed: a little under 4 / 3


@pytest.mark.parametrize("batch", [0, -1, 1.5, True, "2"])
def test_a_bad_batch_is_refused(batch):
    with pytest.raises(ValueError, match=f"batch={batch!r} must be a positive integer"):
        lm_mfu.measure("tiny", batch, jax.devices()[0])


def test_bad_configs_and_counts_are_refused():
    with pytest.raises(
        ValueError, match=r"config='huge' is not a transformer size: pass one of \['cpu'"
    ):
        lm_mfu.measure("huge", 1, jax.devices()[0])
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        lm_mfu.measure("tiny", 1, jax.devices()[0], steps=0)
    with pytest.raises(ValueError, match="learning_rate=0 must be > 0"):
        lm_mfu.make_step(transformer.TINY, learning_rate=0)
    with pytest.raises(ValueError, match="each must name a value"):
        lm_mfu.sweep("tiny", jax.devices()[0], batches=())
    assert lm_mfu.resolve_config(transformer.GPU) == ("gpu", transformer.GPU)


class _Chip:
    """A device whose allocator has 1 MiB free."""

    device_kind, platform = "TPU v5 lite", "tpu"

    def memory_stats(self):
        return {"bytes_limit": 2**21, "bytes_in_use": 2**20, "peak_bytes_in_use": 2**20}


def test_a_program_larger_than_the_free_memory_is_refused_before_it_runs():
    memory = {"argument": 2**20, "output": 2**19, "temp": 2**20, "alias": 2**19}
    with pytest.raises(
        lm_mfu.OutOfMemory, match=r"holds 2\.0 MiB .* 1\.0 MiB free on TPU v5 lite"
    ) as err:
        lm_mfu._check_fit(memory, _Chip(), "gpu", 8)
    assert (err.value.need_bytes, err.value.free_bytes) == (2**21, 2**20)


def test_a_sweep_stops_at_the_first_batch_that_does_not_fit(monkeypatch):
    tried = []

    def fake(cfg, batch, device, remat, **kwargs):
        tried.append((batch, remat))
        if batch >= 4 or (batch >= 2 and not remat):
            raise lm_mfu.OutOfMemory(f"batch {batch} does not fit")
        row = dict.fromkeys(lm_mfu.FIELDS)
        return type("M", (), {"row": lambda self: {**row, "batch": batch, "remat": remat, "fits": True,
                                                   "step_s": 0.1, "mfu": 0.5, "first_loss": 3.0,
                                                   "last_loss": 2.0}})()  # fmt: skip

    monkeypatch.setattr(lm_mfu, "measure", fake)
    rows = lm_mfu.sweep("gpu", _Chip(), (8, 1, 2, 4), (True, False), log=None)
    assert tried == [(1, True), (2, True), (4, True), (1, False), (2, False)]
    assert [(r["batch"], r["remat"], r["fits"]) for r in rows] == [
        (1, True, True), (2, True, True), (4, True, False), (1, False, True), (2, False, False)
    ]  # fmt: skip
    assert rows[2]["note"] == "batch 4 does not fit" and rows[2]["step_s"] is None
    assert all(r["config"] == "gpu" for r in rows)


def test_the_reference_is_none_until_measured(tmp_path):
    assert lm_mfu.reference(tmp_path / "mfu.csv") is None
    (tmp_path / "mfu.csv").write_text("config,batch,mfu\ngpu,4,0.5\n")
    assert lm_mfu.reference(tmp_path / "mfu.csv").to_dict("records") == [
        {"config": "gpu", "batch": 4, "mfu": 0.5}
    ]


def test_the_committed_reference_is_described_row_by_row():
    committed = lm_mfu.reference()
    if committed is None:
        pytest.skip("no committed measurement")
    lines = lm_mfu.describe_reference(committed)
    assert committed.iloc[0]["device_kind"] in lines[0]
    assert len(lines) == 1 + len(committed) + 1 + committed["ceiling_flops"].notna().any()
    assert any("allocator peak" in line for line in lines)
    need = lm_mfu.program_bytes(committed)
    first = committed.iloc[0]
    assert need.iloc[0] == (
        first["argument_bytes"] + first["output_bytes"] + first["temp_bytes"] - first["alias_bytes"]
    )
    with pytest.raises(KeyError):
        lm_mfu.program_bytes(committed.drop(columns="alias_bytes"))


def tool(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "lm_mfu.py"), *args], capture_output=True, text=True
    )


def test_the_tool_refuses_bad_arguments_and_an_existing_measurement(tmp_path):
    r = tool("--out", str(tmp_path), "--batches", "0")
    assert r.returncode == 2 and "every batch must be a positive integer" in r.stderr
    r = tool("--out", str(tmp_path), "--config", "huge")
    assert r.returncode == 2 and "config='huge' is not a transformer size" in r.stderr
    (tmp_path / "mfu.csv").write_text("kept\n")
    r = tool("--out", str(tmp_path))
    assert r.returncode == 2 and "is never overwritten" in r.stderr
    assert (tmp_path / "mfu.csv").read_text() == "kept\n"


def test_the_largest_batch_that_fits_is_found_from_the_top(monkeypatch):
    tried = []

    def fake(cfg, batch, device, remat, **kwargs):
        tried.append(batch)
        if batch >= 4:
            raise lm_mfu.OutOfMemory(f"batch {batch} does not fit")
        return ("measured", batch, remat)

    monkeypatch.setattr(lm_mfu, "measure", fake)
    lines = []
    assert lm_mfu.largest_batch("gpu", _Chip(), (1, 2, 4, 8), log=lines.append) == (
        "measured",
        2,
        True,
    )
    assert tried == [8, 4, 2] and lines[0].startswith("batch 8, remat=True: does not fit")
    assert lm_mfu.largest_batch("gpu", _Chip(), (4, 8), remat=False, log=None) is None
    with pytest.raises(ValueError, match=r"batches=\(\) must name at least one batch"):
        lm_mfu.largest_batch("gpu", _Chip(), ())
    with pytest.raises(ValueError, match="batch=0 must be a positive integer"):
        lm_mfu.largest_batch("gpu", _Chip(), (0, 1))
