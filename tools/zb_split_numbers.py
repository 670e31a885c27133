"""Lesson 11's ZB-H1 numbers (sections 5b and 5c) with the plain residual stage and with the split one.

    .venv/bin/python tools/zb_split_numbers.py            # 8 simulated CPU devices, as nbmake runs lesson 11

Rebuilds the configuration of ``notebooks/11_pipeline_experts.ipynb`` (profile "cpu": ``p = 4`` stages,
``m = 8`` micro-batches, four residual layers of width 128 per device, a quarter of 256 rows, the parity
dtype) and prints, for ``pipeline_measure.residual_stage()`` and ``residual_stage(split=True)``:
``pipeline_ops.op_flops`` in units of F, ZB-H1's and 1F1B's work per device, the predicted masked /
switched ratios of cell ``op-waiting``, the plan's slots at ``m`` and ``2m``, ``memory_analysis()``'s
temporaries of the switched ZB-H1 step at ``m`` and ``2m`` (cell ``op-memory``), and the parity of ZB-H1
(both modes) against one device. Nothing is asserted here: it gives the numbers a lesson edit would state.
"""

from __future__ import annotations

import os
import sys

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={N}")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from course_lib import op_schedules as O  # noqa: E402
from course_lib import pipeline as PL  # noqa: E402
from course_lib import pipeline_measure as PM  # noqa: E402
from course_lib import pipeline_ops as PO  # noqa: E402
from course_lib import precision  # noqa: E402
from course_lib.meshes import STAGE, mesh_of  # noqa: E402


def main() -> None:
    devices = jax.devices()
    p = max(s for s in (4, 2, 1) if s <= len(devices))
    m, width, rows = 2 * p, 128, 256 // 4
    dtype, once = precision.parity_dtype(), {"xla_backend_optimization_level": 0}
    mesh = mesh_of({STAGE: p}, devices[:p], axis_type="auto")
    print(
        f"{jax.default_backend()}: p={p}, m={m}, rows={rows}, width={width}, {np.dtype(dtype).name}"
    )
    with precision.parity_x64():
        key = jax.random.key(0)
        w = PM.init_residual(jax.random.fold_in(key, 5), 4 * p, width, dtype)
        xs, r = (
            jax.random.normal(jax.random.fold_in(key, i), (m, rows, width), dtype) for i in (6, 7)
        )
        act = rows * width * np.dtype(dtype).itemsize
        for split in (False, True):
            stage = PM.residual_stage(split=split)
            ref = jax.value_and_grad(
                lambda w_, x_, f=stage: (jax.vmap(lambda xi: f(xi, w_))(x_) * r).sum(), (0, 1)
            )
            ref_loss, (ref_w, ref_x) = ref(w, xs)
            cost = PO.op_flops(stage, {"w": w["w"][:4]}, xs[0])
            zb, one_f = O.zb_h1(p, m), O.pipedream_flush(p, m)
            work, work_1f = PO.work(zb, cost), PO.work(one_f, cost)
            per = {O.F: cost["F"], O.B: cost["B_split"], O.W: cost["W"]}
            switched = sum(max(per.get(int(o), 0.0) for o in row) for row in zb.op)
            print(f"\n== {'split' if split else 'plain'} stage ({type(stage).__name__})")
            print(
                "op_flops / F:",
                {k: round(v / cost["F"], 3) for k, v in cost.items()},
                f"F = {cost['F']:.4g}",
            )
            print(f"useful work per device: ZB-H1 {work['useful'] / cost['F']:.2f} F, 1F1B "
                  f"{work_1f['useful'] / cost['F']:.2f} F ({work['useful'] / work_1f['useful']:.3f}x)")  # fmt: skip
            print(f"ZB-H1 masked/useful {work['masked'] / work['useful']:.3f}; masked {work['masked']:.4g} vs "
                  f"switched ticks {switched:.4g}: {work['masked'] / switched:.2f}x")  # fmt: skip
            temps = []
            for mm in (m, 2 * m):
                t = O.zb_h1(p, mm)
                pl = PO.plan(t, split)
                spec = jax.ShapeDtypeStruct((mm, rows, width), dtype)
                step = PO.build_step(mesh, STAGE, t, stage, mode="cond")
                temps.append(
                    step.lower(PL.chunked(w, 1), spec, spec)
                    .compile(once)
                    .memory_analysis()
                    .temp_size_in_bytes
                )
                busy = np.isin(pl.rows[..., 0], (O.F, O.B))  # a saving W reads no input slot
                per_stage = [int(pl.rows[busy[:, s], s, 3].max()) + 1 for s in range(p)]
                print(f"m={mm}: slots (inputs, cotangents, saved) {pl.n_x, pl.n_dy, pl.n_saved}; input slots per "
                      f"stage {per_stage}; temp bytes {temps[-1]:,}")  # fmt: skip
            grown = temps[1] - temps[0]
            print(f"temp grows {grown:,} = {m} input cotangents ({m * act:,}) {grown - m * act:+,}; "
                  f"one activation {act:,} bytes; saved per micro-batch 2k = 8 activations")  # fmt: skip
            for mode in PO.MODES:
                loss, g, dx, _ = PO.build_step(mesh, STAGE, zb, stage, mode=mode)(
                    PL.chunked(w, 1), xs, r
                )
                worst = max(abs(float(loss - ref_loss)), float(abs(PL.unchunked(g)["w"] - ref_w["w"]).max()),
                            float(abs(dx - ref_x).max()))  # fmt: skip
                print(f"ZB-H1 {mode}: worst difference against one device {worst:.1e}")


if __name__ == "__main__":
    main()
