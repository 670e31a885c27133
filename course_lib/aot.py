"""Programs compiled for devices you do not have: the course's parallel programs as XLA:TPU builds them for an
8-chip TPU v5e (``2x4``), read beside XLA:CPU's build of the same programs on 8 simulated devices.

On a host with one TPU chip, ``jax.experimental.topologies.get_topology_desc("v5e:2x4", "tpu").devices`` are
8 *compile-only* devices: a mesh can be made of them, ``jax.ShapeDtypeStruct`` arguments can carry
``NamedSharding`` on that mesh, and ``jax.jit(f).lower(*args).compile()`` returns the program XLA:TPU would
run on 8 chips (``as_text()``, ``memory_analysis()``, ``cost_analysis()``); nothing is placed and nothing runs.
:func:`devices` makes either kind of device list; :func:`compile_all` compiles the catalogue of
:mod:`course_lib.aot_programs` (lab 08's strategies, lesson 10's splits, lab 12's layouts) on it and
:func:`summarise` reads each program with :func:`course_lib.programs.collective_ops`.

``tools/tpu_programs.py`` writes the summaries (``programs.json``) and the HLO texts; the TPU host's output is
kept in ``data/tpu_reference/programs/`` (:data:`REFERENCE_DIR`). :func:`reference` reads it, and
:func:`compare` sets a program's collectives on XLA:CPU (compiled here, now, or compiled by the notebook and
passed as its :func:`summarise` summary) beside XLA:TPU's (the reference, or :func:`tpu_summary`'s, compiled
live on a TPU host): kind, dtypes, bytes, asynchronous pairs and loop placement
(:mod:`course_lib.aot_compare`: :func:`differences` in words, :func:`overview` per program, :func:`label`
names the compiler, devices and JAX), for ``notebooks/08_lab.ipynb``,
``notebooks/10_transformers.ipynb`` and ``notebooks/12_transformer_lab.ipynb``. In a notebook on 8 simulated
CPU devices::

    from course_lib import aot
    aot.compare("lab08.sharded_jit.bfloat16", devices)   # one row per (collective, axes), "same" per row
    aot.compare(name, aot.summarise(compiled, mesh)[0])   # a program the notebook compiled itself
    aot.collective_table(aot.reference("lesson10.collective_matmul"))   # XLA:TPU's alone, any device count

The catalogue's names are :data:`course_lib.aot_programs.PROGRAMS`' keys. A program that differs on the two
compilers is the point of the comparison: XLA:CPU promotes bfloat16 all-reduces to float32, runs every
collective synchronously and writes loop trip counts; XLA:TPU may keep bfloat16, issue start/done pairs
that overlap with compute, combine collectives differently, and writes no trip counts.
"""

from __future__ import annotations

import gzip
import json
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax

from . import aot_programs
from .aot_compare import (  # noqa: F401 - the comparison's functions, read as aot.<name>
    collective_table,
    compare_summaries,
    differences,
    label,
    overview,
)
from .programs import arrays, collective_ops

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "data" / "tpu_reference" / "programs"
"""Where the TPU host's ``programs.json`` and ``hlo/*.txt.gz`` are kept (written by ``tools/tpu_programs.py``)."""
TOPOLOGY = "v5e:2x4"
"""The TPU slice compiled for: 8 TPU v5e chips in a 2 × 4 torus."""


def devices(topology: str | None = TOPOLOGY, n: int = aot_programs.N_DEVICES) -> list:
    """The devices to compile for: the compile-only devices of a TPU ``topology``, or with ``topology=None``
    the first ``n`` devices of the default backend (8 simulated CPU devices in the tests).

    Returns:
      A list of ``n`` devices, in the order ``jax.devices()`` lists them on a host that has them (the order
      the course's meshes are built from).

    Raises:
      ValueError: fewer than ``n`` devices (for the CPU, the fix: ``setup_devices(8, "cpu")`` first), or a
        topology with another number of chips.
      RuntimeError: no TPU backend here (``topologies`` needs libtpu: run on a TPU host, or pass None).
    """
    if topology is None:
        found = jax.devices()
        if len(found) < n:
            raise ValueError(
                f"{len(found)} {found[0].platform} device(s) present, {n} needed; start with "
                f"course_lib.devices.setup_devices({n}, 'cpu') before JAX is used"
            )
        return list(found[:n])
    from jax.experimental import topologies

    found = list(topologies.get_topology_desc(topology, "tpu").devices)
    if len(found) != n:
        raise ValueError(f"topology {topology!r} has {len(found)} chips, not {n}; use a 2x4 slice")
    return found


def _memory(compiled) -> dict | None:
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    fields = ("argument", "output", "temp", "alias", "generated_code")
    return {f: int(getattr(ma, f"{f}_size_in_bytes", 0)) for f in fields}


def _cost(compiled) -> dict | None:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) and ca else ca
    if not ca:
        return None
    return {
        "flops": float(ca.get("flops", 0.0)),
        "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
    }


def _collectives(text: str, mesh_shape: dict) -> tuple[list[dict], str | None]:
    try:
        ops, note = collective_ops(text, mesh_shape), None
    except ValueError as e:  # groups over sub-axes: read without naming the axes
        ops, note = collective_ops(text), str(e)
    rows = [
        {
            "op": o.op,
            "dtypes": [dtype for dtype, _ in arrays(o.shape)],
            "shape": o.shape.split("{")[0] if "(" not in o.shape else o.shape,
            "bytes": o.nbytes,
            "bytes_sent": o.bytes_sent,
            "axes": None if o.axes is None else list(o.axes),
            "group_size": o.group_size,
            "async": o.asynchronous,
            "in_loop": o.in_loop,
            "runs": o.runs,
            "computation": o.computation,
            "name": o.name,
        }
        for o in ops
    ]
    return rows, note


def summarise(compiled: Any, mesh: Any, *, topology: str | None = None) -> tuple[dict, str]:
    """What a compiled program does, as plain JSON-ready values, and its HLO text.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()``.
      mesh: the mesh its arguments are placed on (names the collectives' axes).
      topology: the TPU topology it was compiled for (recorded), None for attached devices.

    Returns:
      ``(summary, hlo_text)``. ``summary``: ``platform`` (``"tpu"``/``"cpu"``), ``device_kind``,
      ``topology``, ``mesh`` (axis → size), ``collectives`` (one dict per instruction, an async pair once:
      ``op``, ``dtypes`` (HLO names, ``"bf16"``), ``shape``, ``bytes`` of its result on one device,
      ``bytes_sent`` (ring model, :attr:`course_lib.programs.CollectiveOp.bytes_sent`), ``axes``,
      ``group_size``, ``async``, ``in_loop``, ``runs`` (None: in a loop of unknown trip count; XLA:TPU
      writes none), ``computation``, ``name``), ``async_starts`` (collectives issued as start/done pairs),
      ``while_loops``, ``memory`` (bytes per device: ``argument``, ``output``, ``temp``, ``alias``,
      ``generated_code``; ``memory_analysis()``), ``cost`` (``flops``, ``bytes_accessed``:
      ``cost_analysis()``, each loop body counted once), ``collectives_note`` (why axes are unnamed).
    """
    text = compiled.as_text()
    device = mesh.devices.flat[0]
    mesh_shape = {str(k): int(v) for k, v in mesh.shape.items()}
    rows, note = _collectives(text, mesh_shape)
    summary = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "topology": topology,
        "mesh": mesh_shape,
        "collectives": rows,
        "async_starts": sum(bool(c["async"]) for c in rows),
        "while_loops": text.count(" while("),
        "memory": _memory(compiled),
        "cost": _cost(compiled),
        "collectives_note": note,
    }
    return summary, text


def compile_program(
    name: str, devs: Sequence[Any], *, profile: str = "cpu", topology=None
) -> tuple:
    """Build program ``name`` of :data:`course_lib.aot_programs.PROGRAMS` on ``devs``, compile it, read it.

    Returns:
      ``(summary, hlo_text)``: :func:`summarise`'s, plus ``name``, ``notebook``, ``about``, ``profile``,
      ``compile_s`` (seconds to build, lower and compile) and ``error`` (None); on failure ``summary`` holds
      ``error`` (the exception's type and message) and ``traceback`` (its last frames), and ``hlo_text`` is
      None: a failure is recorded, not raised.

    Raises:
      ValueError: an unknown ``name`` (the message lists them).
    """
    if name not in aot_programs.PROGRAMS:
        raise ValueError(f"unknown program {name!r}; choose from {list(aot_programs.PROGRAMS)}")
    prog = aot_programs.PROGRAMS[name]
    head = {"name": name, "notebook": prog.notebook, "about": prog.about, "profile": profile}
    t0 = time.perf_counter()
    try:
        fn, args, mesh = prog.make(list(devs), profile)
        compiled = fn.lower(*args).compile()
        summary, text = summarise(compiled, mesh, topology=topology)
    except Exception as e:  # noqa: BLE001 - recorded with the program, the others still compile
        where = traceback.format_exc(limit=-6)[-3000:]
        return {**head, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": where}, None
    return {**head, **summary, "compile_s": round(time.perf_counter() - t0, 2), "error": None}, text


def compile_all(
    devs: Sequence[Any],
    names: Iterable[str] | None = None,
    *,
    profile: str = "cpu",
    topology: str | None = None,
    jobs: int = 1,
    on_done: Callable[[str, dict], Any] | None = None,
) -> dict[str, tuple[dict, str | None]]:
    """:func:`compile_program` for every name (default: the whole catalogue): ``{name: (summary,
    hlo_text)}`` in the order given. ``jobs`` > 1 compiles that many at once in threads (XLA compiles
    with the GIL released; each summary's ``compile_s`` is then its time beside the others).
    ``on_done(name, summary)`` is called as each program is done (progress)."""
    names = list(aot_programs.PROGRAMS) if names is None else list(names)

    def one(name):
        done = compile_program(name, devs, profile=profile, topology=topology)
        if on_done is not None:
            on_done(name, done[0])
        return done

    if jobs <= 1:
        return {n: one(n) for n in names}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        return dict(zip(names, pool.map(one, names)))


def write(results: dict[str, tuple[dict, str | None]], out_dir: str | Path, meta: dict) -> Path:
    """Write ``out_dir/programs.json`` (``{"meta": meta, "programs": {name: summary}}``) and each program's
    HLO text as ``out_dir/hlo/<name>.txt.gz``; returns the JSON file's path."""
    out = Path(out_dir)
    (out / "hlo").mkdir(parents=True, exist_ok=True)
    for name, (_, text) in results.items():
        if text is not None:
            with gzip.open(out / "hlo" / f"{name}.txt.gz", "wt", compresslevel=9) as f:
                f.write(text)
    doc = {"meta": meta, "programs": {n: s for n, (s, _) in results.items()}}
    path = out / "programs.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load(path: str | Path | None = None) -> dict:
    """``programs.json`` as written by :func:`write` (default: :data:`REFERENCE_DIR`'s, the TPU reference).

    Raises:
      FileNotFoundError: no such file; the message says how the reference is made.
    """
    path = Path(path) if path is not None else REFERENCE_DIR / "programs.json"
    if path.is_dir():
        path = path / "programs.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: it is written on a TPU host by "
            f"`python tools/tpu_programs.py --out {path.parent}`"
        )
    return json.loads(path.read_text())


def reference(name: str, path: str | Path | None = None) -> dict:
    """Program ``name``'s summary in the reference (:func:`load`): XLA:TPU's program for 8 chips.

    Raises:
      FileNotFoundError: no reference file (see :func:`load`).
      KeyError: the reference has no program ``name`` (the message lists those it has).
    """
    programs = load(path)["programs"]
    if name not in programs:
        raise KeyError(f"the reference has no program {name!r}; it has {sorted(programs)}")
    return programs[name]


def tpu_summary(name: str, *, path: str | Path | None = None, live: bool | None = None) -> dict:
    """XLA:TPU's program ``name`` for the 8-chip slice: compiled now for :data:`TOPOLOGY` on a TPU host,
    else read from the reference (:func:`reference`).

    Args:
      live: True: compile now (needs a TPU backend); False: the reference; None: live when JAX has a TPU
        backend here.

    Returns:
      A summary as :func:`compile_program` makes it, plus ``jax`` (the version that compiled it),
      ``host_devices`` (the TPU chips of the host that compiled it; None where the reference does not
      record it) and ``source`` (``"reference"`` or ``"compiled now"``), which :func:`label` names; a live
      one at the reference's ``profile`` when there is a reference, else ``"cpu"``.

    Raises:
      RuntimeError: ``live=True`` without a TPU backend.
      FileNotFoundError, KeyError: no reference, or none for ``name`` (not live).
    """
    if live is None:
        try:
            live = bool(jax.devices("tpu"))
        except RuntimeError:
            live = False
    if not live:
        meta = load(path)["meta"]
        about = {k: meta.get(k) for k in ("jax", "host_devices")}
        return {**reference(name, path), **about, "source": "reference"}
    try:
        profile = reference(name, path).get("profile", "cpu")
    except (FileNotFoundError, KeyError):
        profile = "cpu"
    summary = compile_program(name, devices(TOPOLOGY), profile=profile, topology=TOPOLOGY)[0]
    host = {"jax": jax.__version__, "host_devices": len(jax.devices("tpu"))}
    return {**summary, **host, "source": "compiled now"}


def tpu_summaries(
    names: Iterable[str], *, path: str | Path | None = None, live: bool | None = None, jobs: int = 4
) -> dict[str, dict]:
    """:func:`tpu_summary` of every name, ``{name: summary}`` in the order given; compiled live (on a TPU
    host) ``jobs`` at once in threads (XLA compiles with the GIL released), else read from the reference."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(names)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = pool.map(lambda n: tpu_summary(n, path=path, live=live), names)
        return dict(zip(names, done))


def hlo_text(name: str, path: str | Path | None = None) -> str:
    """The reference's HLO text of program ``name`` (``hlo/<name>.txt.gz`` beside ``programs.json``)."""
    base = Path(path) if path is not None else REFERENCE_DIR
    base = base.parent if base.suffix == ".json" else base
    with gzip.open(base / "hlo" / f"{name}.txt.gz", "rt") as f:
        return f.read()


def compare(
    name: str,
    cpu: dict | Sequence[Any] | None = None,
    *,
    path: str | Path | None = None,
    tpu: dict | None = None,
):
    """Program ``name`` as XLA:CPU builds it beside XLA:TPU's: :func:`compare_summaries`'s table.

    Args:
      cpu: XLA:CPU's side: a summary (:func:`summarise` of the program a notebook compiled itself), or
        the devices to compile it on now (default ``jax.devices()``, 8 of them: a notebook's simulated
        CPU devices).
      tpu: XLA:TPU's summary (e.g. :func:`tpu_summary`'s, compiled live on a TPU host); default the
        reference's (:func:`reference`).

    Raises:
      ValueError: not 8 devices (the reference's mesh has 8: run the notebook with ``n_devices=8``), a
        summary on another mesh than the reference's (not the same program), or the program failed to
        compile there (the reference's error) or here (its error).
      FileNotFoundError, KeyError: as :func:`reference`.
    """
    tpu = reference(name, path) if tpu is None else tpu
    if tpu.get("error"):
        raise ValueError(
            f"the reference records that {name} did not compile for the TPU: {tpu['error']}"
        )
    if isinstance(cpu, dict):
        if cpu.get("mesh") != tpu.get("mesh"):
            raise ValueError(
                f"{name}: the program given runs on mesh {cpu.get('mesh')}, XLA:TPU's on "
                f"{tpu.get('mesh')}: not the same program; compare at n_devices={aot_programs.N_DEVICES}"
            )
        return compare_summaries(cpu, tpu)
    devs = list(jax.devices() if cpu is None else cpu)
    if len(devs) != aot_programs.N_DEVICES:
        raise ValueError(
            f"{len(devs)} device(s) given; the reference was compiled for {aot_programs.N_DEVICES}: "
            f"compare at n_devices={aot_programs.N_DEVICES}"
        )
    here, _ = compile_program(name, devs, profile=tpu.get("profile", "cpu"))
    if here["error"]:
        raise ValueError(f"{name} does not compile on {devs[0].platform}: {here['error']}")
    return compare_summaries(here, tpu)
