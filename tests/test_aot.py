"""The programs compiled for devices one does not have (course_lib.aot), on the CPU path: the same catalogue
compiled for 8 simulated CPU devices (XLA:CPU), read, written, and set beside a reference. The TPU path
differs only in its devices (a topology's compile-only devices), which need a TPU host; tools/tpu_programs.py
runs it there."""

import gzip
import json

import jax
import pytest
from jax.sharding import PartitionSpec as P

from course_lib import aot, aot_programs, model, parallel
from course_lib.config import PROFILES, init_run
from course_lib.programs import collective_ops, computation_runs, loop_computations

N = aot_programs.N_DEVICES


@pytest.fixture(scope="module")
def devs():
    return aot.devices(None)


@pytest.fixture(scope="module")
def compiled(devs):
    """A few cheap programs of the catalogue, compiled once for the module (lab 08 at the tiny profile)."""
    names = [
        "lab08.sharded_jit.float32",
        "lab08.sharded_jit.bfloat16",
        "lesson10.ring_attention",
        "lesson10.allgather_matmul",
        "lesson10.collective_matmul",
        "lesson10.collective_matmul_bidi",
        "lesson10.matmul_reducescatter",
        "lesson10.collective_matmul_rs",
    ]
    return aot.compile_all(devs, names, profile="tiny", jobs=2)  # two at once: the threaded path


def _ops(summary, op):
    return [c for c in summary["collectives"] if c["op"] == op]


def test_the_catalogue_names_its_notebooks_and_covers_the_three_lessons():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = list(aot_programs.PROGRAMS)
    assert len(names) == len(set(names)) == 29
    # every program is in the committed XLA:TPU reference (tools/tpu_programs.py on a TPU host)
    assert set(names) <= set(
        json.loads(aot.REFERENCE_DIR.joinpath("programs.json").read_text())["programs"]
    )
    for prefix in ("lab08.", "lesson10.", "lab12."):
        assert any(n.startswith(prefix) for n in names), prefix
    for prog in aot_programs.PROGRAMS.values():
        assert (root / prog.notebook).exists(), prog


def test_the_sizes_are_the_notebooks_own():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def source(nb):
        cells = json.loads((root / "notebooks" / nb).read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells)

    c = aot_programs.LESSON10_CONFIG
    names = ("vocab", "seq_len", "d_model", "n_heads", "d_ff", "n_layers")  # ln_eps: its default
    sizes = ", ".join(f"{name}={getattr(c, name)}" for name in names)
    cpu = f'"cpu": dict(model=transformer.TransformerConfig({sizes}), batch={aot_programs.LESSON10_BATCH}'
    assert "".join(cpu.split()) in "".join(source("10_transformers.ipynb").split())
    lab12 = source("12_transformer_lab.ipynb")
    assert "config = transformer.TINY" in lab12
    assert f"global_batch = {aot_programs.LAB12_BATCH} " in lab12


def test_devices(devs):
    assert len(devs) == N and all(d.platform == "cpu" for d in devs)
    with pytest.raises(ValueError, match="9 needed"):
        aot.devices(None, n=9)
    if not any(d.platform == "tpu" for d in jax.devices()):
        with pytest.raises(RuntimeError):  # compile-only TPU devices need libtpu
            aot.devices("v5e:2x4")


def test_data_parallel_all_reduces_the_gradients_once(compiled):
    """D in float32: one all-reduce over data of every gradient (the parameters' bytes) and the loss."""
    d, _ = compiled["lab08.sharded_jit.float32"]
    assert d["error"] is None and d["platform"] == "cpu" and d["mesh"] == {"data": N}
    params = init_run(PROFILES["tiny"], 0, abstract_params=True).params
    param_bytes = model.param_bytes(params)
    (ar,) = _ops(d, "all-reduce")  # XLA:CPU combines them into one tuple all-reduce
    assert ar["axes"] == ["data"] and ar["group_size"] == N and set(ar["dtypes"]) == {"f32"}
    assert ar["bytes"] == param_bytes + 4  # every gradient, and the loss (a float32 scalar)
    assert ar["bytes_sent"] == pytest.approx(2 * (N - 1) / N * ar["bytes"])
    assert not ar["async"] and not ar["in_loop"] and ar["runs"] == 1
    assert {c["op"] for c in d["collectives"]} == {"all-reduce"}
    assert d["async_starts"] == 0 and d["while_loops"] == 0  # XLA:CPU: synchronous, no loop here
    # replicated state (parameters and momentum) and this device's eighth of the batch
    cfg = PROFILES["tiny"]
    m, b = cfg.model, cfg.global_batch // N
    assert (
        d["memory"]["argument"] == 2 * param_bytes + b * m.image_size**2 * m.in_channels * 4 + b * 4
    )
    assert d["cost"]["flops"] > 0 and d["cost"]["bytes_accessed"] > 0


def test_bfloat16_partial_sums_are_promoted_on_cpu(compiled):
    """D in bfloat16: the partitioner asks for bfloat16 all-reduces; XLA:CPU reduces in float32 (the same
    bytes as float32). XLA:TPU keeps bfloat16: the reference records it."""
    f32, _ = compiled["lab08.sharded_jit.float32"]
    bf16, text = compiled["lab08.sharded_jit.bfloat16"]
    assert bf16["error"] is None and "bf16" in text  # the program computes in bfloat16
    assert {dt for c in _ops(bf16, "all-reduce") for dt in c["dtypes"]} == {"f32"}
    assert sum(c["bytes"] for c in _ops(bf16, "all-reduce")) == sum(
        c["bytes"] for c in _ops(f32, "all-reduce")
    )


def test_ring_attention_permutes_in_its_loop(compiled):
    ring, _ = compiled["lesson10.ring_attention"]
    c = aot_programs.LESSON10_CONFIG
    block = aot_programs.LESSON10_BATCH * (c.seq_len // N) * c.n_heads * c.d_head * 4  # float32
    perms = _ops(ring, "collective-permute")
    assert len(perms) == 2 and len(ring["collectives"]) == 2  # K and V
    for p in perms:
        assert p["bytes"] == block and p["axes"] == ["context"]
        assert (
            p["in_loop"] and p["runs"] == N - 1
        )  # the fori_loop's n-1 steps (XLA:CPU writes the count)
    assert ring["while_loops"] >= 1


def test_collective_matmul_sends_the_all_gathers_bytes(compiled):
    plain, _ = compiled["lesson10.allgather_matmul"]
    ring, _ = compiled["lesson10.collective_matmul"]
    d = aot_programs.LESSON10_CONFIG.d_model
    (ag,) = _ops(plain, "all-gather")
    assert ag["bytes"] == 8 * N * d * 4 and ag["axes"] == ["model"]  # x gathered: [8n, D] float32
    perms = _ops(ring, "collective-permute")
    assert len(perms) == N - 1 and all(p["bytes"] == 8 * d * 4 for p in perms)  # one block per step
    assert sum(p["bytes_sent"] for p in perms) == pytest.approx(ag["bytes_sent"])
    assert not any(p["async"] or p["in_loop"] for p in perms)  # XLA:CPU: synchronous, unrolled


def test_the_bidirectional_and_reduce_scatter_rings(compiled):
    """The bidirectional ring sends half a block each way at every step (the all-gather's bytes in all);
    the reduce-scatter ring passes n − 1 partial sums (the reduce-scatter's bytes)."""
    d = aot_programs.LESSON10_CONFIG.d_model
    plain, _ = compiled["lesson10.allgather_matmul"]
    bidi, _ = compiled["lesson10.collective_matmul_bidi"]
    perms = _ops(bidi, "collective-permute")
    assert len(perms) == 2 * (N - 1) and all(p["bytes"] == 4 * d * 4 for p in perms)
    assert sum(p["bytes_sent"] for p in perms) == pytest.approx(
        _ops(plain, "all-gather")[0]["bytes_sent"]
    )
    rs_plain, _ = compiled["lesson10.matmul_reducescatter"]
    rs_ring, _ = compiled["lesson10.collective_matmul_rs"]
    (rs,) = _ops(rs_plain, "reduce-scatter")
    perms = _ops(rs_ring, "collective-permute")
    assert len(perms) == N - 1 and all(
        p["bytes"] == 8 * d * 4 for p in perms
    )  # an [8, D] partial sum
    assert sum(p["bytes_sent"] for p in perms) == pytest.approx(rs["bytes_sent"])
    assert {c["op"] for c in rs_ring["collectives"]} == {"collective-permute"}


def test_a_program_that_fails_is_recorded(devs, monkeypatch):
    def broken(devices, profile):
        raise ValueError("no such layout")

    prog = aot_programs.Program("broken", "notebooks/10_transformers.ipynb", "fails", broken)
    monkeypatch.setitem(aot_programs.PROGRAMS, "broken", prog)
    summary, text = aot.compile_program("broken", devs)
    assert text is None and summary["error"] == "ValueError: no such layout"
    with pytest.raises(ValueError, match="unknown program 'nope'"):
        aot.compile_program("nope", devs)


def test_written_reference_reads_back_and_compares(compiled, devs, tmp_path):
    results = {k: compiled[k] for k in ("lesson10.ring_attention", "lesson10.collective_matmul")}
    path = aot.write(results, tmp_path, {"platform": "cpu"})
    assert json.loads(path.read_text())["meta"] == {"platform": "cpu"}
    ref = aot.reference("lesson10.ring_attention", tmp_path)
    assert ref == json.loads(json.dumps(results["lesson10.ring_attention"][0]))
    assert (
        aot.hlo_text("lesson10.ring_attention", tmp_path) == results["lesson10.ring_attention"][1]
    )
    with pytest.raises(KeyError, match="no program 'lab12.dp'"):
        aot.reference("lab12.dp", tmp_path)
    with pytest.raises(FileNotFoundError, match="tpu_programs.py"):
        aot.load(tmp_path / "missing")
    table = aot.compare("lesson10.collective_matmul", devs, path=tmp_path)
    assert list(table["op"]) == ["collective-permute"] and table["same"].all()
    assert table["XLA:CPU n"].iloc[0] == table["XLA:CPU (reference) n"].iloc[0] == N - 1
    with pytest.raises(ValueError, match="compare at n_devices=8"):
        aot.compare("lesson10.collective_matmul", devs[:4], path=tmp_path)
    # a reference that differs: as XLA:TPU builds it, the permutes are asynchronous pairs
    tpu = json.loads(json.dumps(ref))
    tpu["platform"] = "tpu"
    for c in tpu["collectives"]:
        c["async"] = True
    table = aot.compare_summaries(results["lesson10.ring_attention"][0], tpu)
    assert not table["same"].any() and table["XLA:TPU async"].iloc[0] == 2
    assert list(aot.collective_table(tpu)["async"]) == [True, True]


def test_a_summary_the_notebook_compiled_is_compared_and_labelled(compiled):
    """The notebooks pass their own compiled programs (a summary); the platform is named with its JAX."""
    here, _ = compiled["lesson10.collective_matmul"]
    assert aot.label(here) == f"XLA:CPU on 8 simulated devices, JAX {jax.__version__}"
    tpu = json.loads(json.dumps(here)) | {"platform": "tpu", "topology": "v5e:2x4", "jax": "0.10.2"}
    assert aot.label(tpu | {"host_devices": 1}) == (
        "XLA:TPU for v5e:2x4, compiled on one chip, JAX 0.10.2"
    )
    assert aot.label(tpu | {"host_devices": 8}).endswith(
        "compiled on a host of 8 chips, JAX 0.10.2"
    )
    table = aot.compare("lesson10.collective_matmul", here, tpu=tpu)
    assert table["same"].all() and aot.differences(table) == []
    ring, _ = compiled["lesson10.ring_attention"]  # on another mesh: not the same program
    with pytest.raises(ValueError, match="not the same program"):
        aot.compare("lesson10.collective_matmul", ring, tpu=tpu)


def test_the_reference_is_read_as_xla_tpu_for_one_chip_and_its_differences_are_computed():
    """The committed reference (no compile): D's float32 and bfloat16 programs set side by side."""
    d32 = aot.tpu_summary("lab08.sharded_jit.float32", live=False)
    assert d32["source"] == "reference" and d32["platform"] == "tpu"
    assert aot.label(d32) == "XLA:TPU for v5e:2x4, compiled on one chip, JAX 0.10.2"
    d16 = aot.reference("lab08.sharded_jit.bfloat16")
    table = aot.compare_summaries(d32, d16)
    (line,) = aot.differences(table)
    assert line == (
        "all-reduce over data: instructions 1 on XLA:TPU, 2 on XLA:TPU (reference); dtypes f32 on "
        "XLA:TPU, bf16,f32 on XLA:TPU (reference); bytes 755,244 on XLA:TPU, 377,624 on XLA:TPU "
        "(reference)"
    )
    # the bfloat16 gradients: every leaf in one all-reduce, half the float32 bytes; the loss apart
    loss, grads = sorted(d16["collectives"], key=lambda c: c["bytes"])
    assert loss["dtypes"] == ["f32"] and grads["bytes"] * 2 + 4 == d32["collectives"][0]["bytes"]
    names = ["lab08.sharded_jit.float32", "lab08.sharded_jit.bfloat16"]
    tpu = aot.tpu_summaries(names, live=False)
    assert list(tpu) == names and all(s["source"] == "reference" for s in tpu.values())
    alone = aot.overview(tpu)
    assert list(alone.index) == names and "differs" not in alone.columns
    assert list(alone["XLA:TPU collectives"]) == [1, 2]
    assert list(alone["XLA:TPU bytes"]) == [755244, 377624]
    assert list(alone["XLA:TPU dtypes"]) == ["f32", "bf16,f32"]
    both = aot.overview(tpu, {names[1]: d32})  # a stand-in for XLA:CPU's side
    assert both.loc[names[1], "differs"] == "all-reduce over data"
    assert both["XLA:CPU bytes"].isna().tolist() == [True, False]


# HLO as XLA:TPU writes it (shortened): an async permute pair in a while loop without known_trip_count, a
# reduce-scatter wrapped by async-start, and one as XLA prints such a pair in short (start, update, done)
TPU_LIKE = """HloModule m

%wrapped_rs (p: f32[8]) -> f32[1] {
  %p = f32[8]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[1]{0} reduce-scatter(%p), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %cps = (f32[4]{0}, f32[4]{0}) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4]{0} collective-permute-done(%cps)
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %cpd)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4], b: f32[8]) -> f32[4] {
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %async-start = ((f32[8]{0}), f32[1]{0}) async-start(%b), calls=%wrapped_rs
  %async-done = f32[1]{0} async-done(%async-start), calls=%wrapped_rs
  %rss = ((f32[8]{0}), f32[1]{0}) reduce-scatter-start(%b), replica_groups={}, dimensions={0}, to_apply=%add
  %rsu = ((f32[8]{0}), f32[1]{0}) reduce-scatter-update(%rss)
  %rsd = f32[1]{0} reduce-scatter-done(%rsu)
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_the_reader_knows_async_pairs_and_loops_without_a_trip_count():
    assert loop_computations(TPU_LIKE) == {"body", "cond"}
    assert computation_runs(TPU_LIKE)["body"] is None
    rs, perm, rs2 = collective_ops(TPU_LIKE, {"data": 8})  # in text order
    assert (perm.op, perm.asynchronous, perm.in_loop, perm.runs) == (
        "collective-permute",
        True,
        True,
        None,
    )
    assert perm.shape == "f32[4]{0}" and perm.axes == ("data",)
    assert (rs.op, rs.asynchronous, rs.in_loop, rs.runs, rs.nbytes) == (
        "reduce-scatter",
        True,
        False,
        1,
        4,
    )


def test_the_tool_writes_programs_and_hlo(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    try:
        import tpu_programs
    finally:
        sys.path.pop(0)
    out = tmp_path / "out"
    assert (
        tpu_programs.main(["--out", str(out), "--cpu", "--only", "lesson10.allgather_matmul"]) == 0
    )
    doc = json.loads((out / "programs.json").read_text())
    assert doc["meta"]["platform"] == "cpu" and doc["meta"]["topology"] is None
    assert doc["meta"]["host_devices"] == len(jax.devices())
    assert list(doc["programs"]) == ["lesson10.allgather_matmul"]
    with gzip.open(out / "hlo" / "lesson10.allgather_matmul.txt.gz", "rt") as f:
        assert f.read().startswith("HloModule")
    assert tpu_programs.main(["--out", str(out), "--cpu", "--only", "nope"]) == 2
    assert tpu_programs.main(["--out", str(out), "--cpu", "--profile", "huge"]) == 2


def test_fsdp_specs_are_the_registrys():
    """E′'s abstract state is placed by the registry's FSDP specs (what the lab places it by)."""
    params = init_run(PROFILES["tiny"], 0, abstract_params=True).params
    fn, (state, batch), mesh = aot_programs.PROGRAMS["lab08.fsdp_jit.float32"].make(
        aot.devices(None), "tiny"
    )
    specs = parallel.fsdp_specs(params, N)
    got = jax.tree.map(lambda a: a.sharding.spec, state.params)
    is_spec = lambda x: isinstance(x, P)
    assert jax.tree.leaves(got, is_leaf=is_spec) == jax.tree.leaves(specs, is_leaf=is_spec)
    assert any(s != P() for s in jax.tree.leaves(got, is_leaf=is_spec))  # some leaves are split
    assert batch[0].sharding.spec == P("data")


@pytest.mark.tpu
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU backend")
def test_xla_tpu_reduces_in_bfloat16_and_overlaps_the_ring():
    """On a TPU host (``pytest tests/test_aot.py -m tpu``): the programs for 8 chips, compiled on one.
    XLA:TPU keeps D's bfloat16 gradient all-reduce in bfloat16, and issues the collective matmul's
    permutes as start/done pairs (the overlap lesson 10 names)."""
    devs = aot.devices(aot.TOPOLOGY)
    bf16, _ = aot.compile_program("lab08.sharded_jit.bfloat16", devs, topology=aot.TOPOLOGY)
    assert bf16["error"] is None and bf16["platform"] == "tpu", bf16.get("error")
    assert "bf16" in {dt for c in _ops(bf16, "all-reduce") for dt in c["dtypes"]}
    ring, _ = aot.compile_program("lesson10.collective_matmul", devs, topology=aot.TOPOLOGY)
    perms = _ops(ring, "collective-permute")
    assert len(perms) == N - 1 and all(p["async"] for p in perms), perms
