"""Insert lesson 11's one-operation schedule cells (sections 5b and 5c) after section 5; edits the notebook's
JSON keeping every cell id (run once: it refuses to insert twice)."""

import json
import sys
from pathlib import Path

NB = Path(__file__).resolve().parents[1] / "notebooks" / "11_pipeline_experts.ipynb"

S5B = r"""## 5b · One operation per tick: PipeDream-Flush 1F1B, interleaved 1F1B, zero bubble

The tables above are **lockstep**: a tick has two lanes and every stage computes both whenever any stage
uses one. A real device runs **one operation at a time**. `op_schedules` writes tables with one
operation per stage and tick — **F** (a chunk's forward), **B** (its backward), **W** (a weight gradient)
or nothing — each one tick long, a value usable from the tick after the one that made it. Every table
comes from the same rule: each stage has an **order** of operations and runs the next one as soon as its
inputs have arrived. The schedules differ only in their orders; `pipeline_ops.run` is the one executor
for all of them (an input or cotangent that arrives early waits in a slot until its operation runs).

- **GPipe**: all forwards, then all backwards. Bubble `(p-1)/(m+p-1)`, `m` inputs held.
- **1F1B (PipeDream-Flush**, Narayanan et al. 2021): stage `s` runs `p-1-s` warm-up forwards, then one
  forward, one backward, …, then the cool-down backwards. GPipe's bubble, but at most `p-s` micro-batches
  in flight on stage `s`, whatever `m`.
- **Interleaved 1F1B** (Narayanan et al. 2021, §2.2): `v` chunks per device; a tick runs one chunk, `1/v`
  of a stage, so the fill and drain shrink `v` times: bubble `(p-1)/(v·m)` of the ideal step, i.e.
  `(p-1)/(v·m + p-1)` of the step.
- **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward split into **B**, the
  input's gradient (the previous stage waits for it), and **W**, the weights' gradient (nothing waits for
  it). On stage `s` the W of micro-batch `i` runs after the B of micro-batch `i + s`: the W's fill the
  ticks where 1F1B waits. Idle `(p-1)` ticks per stage instead of 1F1B's `3(p-1)` (at `T_F = T_B = T_W`,
  a third), bubble `(p-1)/(3m + p-1)`, and at most `p` micro-batches in flight on any stage — 1F1B's peak.

(The `1f1b` table of sections 3–5 is a lockstep variant: its stage 0 starts a forward at every tick until
the first backward returns, and holds up to `2p - 1`. PipeDream-Flush below holds `p`.) The bubble here is
read from the table as **idle cells over all cells**. For GPipe and 1F1B that
fraction does not depend on how long a backward takes, so the four fractions compare as fractions of each
step."""

TABLES = r"""from course_lib import op_schedules, pipeline_ops  # the one-operation tables and their executor

tables = {
    "gpipe": op_schedules.gpipe(p, m),
    "1f1b": op_schedules.pipedream_flush(p, m),
    "interleaved": op_schedules.interleaved(p, m, 2),
    "zb_h1": op_schedules.zb_h1(p, m),
}
print(f"p={p}, m={m}: one operation per stage per tick; bubble = idle cells / all cells")
for name, t in tables.items():
    op_schedules.validate(t)  # every operation after what it needs
    pred = op_schedules.predicted_bubble(name, p, m, t.n_chunks)
    got = op_schedules.measured_bubble(t)
    flight, want = op_schedules.measured_in_flight(t).tolist(), op_schedules.predicted_in_flight(name, p, m, t.n_chunks)
    print(
        f"{name:11s} v={t.n_chunks}: {t.ticks:3d} ticks, bubble {got:.4f} (predicted {pred:.4f}); "
        f"in flight per stage {flight} (predicted {want})"
    )
    assert abs(got - pred) <= 0.10 * pred and flight == want
if p > 1:
    assert op_schedules.measured_bubble(tables["zb_h1"]) < op_schedules.measured_bubble(tables["1f1b"])
    zb_idle, flush_idle = (int((tables[k].op == 0).sum(0)[0]) for k in ("zb_h1", "1f1b"))
    # in time units of one forward: ZB-H1's ticks all last T_F; 1F1B's idle ticks are p-1 forward-sized and
    # p-1 backward-sized (T_B + T_W = 2 T_F)
    print(
        f"idle per stage: ZB-H1 {zb_idle} ticks = {zb_idle} T_F; 1F1B {flush_idle} ticks = {p - 1} T_F + "
        f"{p - 1} x 2 T_F = {3 * (p - 1)} T_F, three times ZB-H1's (Qi et al. 2023)"
    )
    assert zb_idle == p - 1 and flush_idle == 2 * (p - 1)
"""

BREADTH_MD = r"""**Breadth-first or depth-first.** Interleaving needs an order of (micro-batch, chunk) pairs. Megatron's
interleaved 1F1B is **depth-first**: a group of `p` micro-batches goes through chunk 0, then the same
group through chunk 1, and so on — so the first micro-batches reach the last stage early and their
backwards start during the forwards (1F1B), which bounds what is held. **Breadth-first** (Lamy-Poirier
2023; the looping pipeline) sends every micro-batch through chunk 0 before any goes through chunk 1, all
forwards before the backwards: the same bubble, but every stage holds all `v·m` chunk inputs. What it buys
is the data-parallel gradient sync: its backward finishes the last chunk's weight gradients for every
micro-batch first, so their all-reduce can start while the other chunks' backwards still run; depth-first
completes every chunk's gradients only at the end of the step. The two tables show both (stage 0):"""

BREADTH = r"""if m >= p:
    depth, breadth = tables["interleaved"], op_schedules.breadth_first(p, m, 2)
    op_schedules.validate(breadth)
    for t in (depth, breadth):
        f0 = [f"{i}.{c}" for i, c, o in zip(t.mb[:, 0], t.chunk[:, 0], t.op[:, 0], strict=True) if o == 1]
        # the tick after which every stage has run every B of chunk c: its weight gradients are complete
        done = [int(max(np.nonzero((t.op == 2) & (t.chunk == c))[0])) + 1 for c in range(2)]
        print(
            f"{t.name:13s} stage 0's forwards (micro-batch.chunk): {' '.join(f0[: 2 * p + 2])} …\n"
            f"{'':13s} in flight per stage {op_schedules.measured_in_flight(t).tolist()}; bubble "
            f"{op_schedules.measured_bubble(t):.4f}; chunk gradients complete after ticks {done} of {t.ticks}"
        )
    assert op_schedules.measured_bubble(depth) == op_schedules.measured_bubble(breadth)
    assert op_schedules.measured_in_flight(breadth).max() > op_schedules.measured_in_flight(depth).max() or m == p
    # breadth-first: the last chunk's gradients are complete well before the step ends; depth-first: at the end
    def first_done(t):  # the first tick after which some chunk's weight gradients are complete
        return min(int(max(np.nonzero((t.op == 2) & (t.chunk == c))[0])) + 1 for c in range(2))

    assert first_done(breadth) < first_done(depth) <= depth.ticks
else:
    print(f"(breadth- and depth-first need m >= p; here m={m}, p={p})")"""

RUNS_MD = r"""Each table is now run by `pipeline_ops.build_step` (the residual layers of section 4, four per device so
each of the two chunks has two, on a quarter of its rows; the loss `Σ <y_i, r_i>`), against one device,
in the parity dtype. The
pictures are drawn from the traces every device returns — what it ran at each tick (pale F, dark B,
hatched W, grey idle). ZB-H1 is also compiled in the masked form, for 5c."""

RUNS = r"""stage_fn = pipeline_measure.residual_stage()
op_runs, op_traces = {}, {}
with parity_x64():
    w_res = pipeline_measure.init_residual(jax.random.fold_in(key, 5), 4 * p, size["width"], DTYPE)
    rows = size["rows"] // 4  # a quarter of section 4's rows: the parity dtype is float64 on CPU
    x_res, r_res = (jax.random.normal(jax.random.fold_in(key, i), (m, rows, size["width"]), DTYPE) for i in (6, 7))
    one_device = jax.jit(
        jax.value_and_grad(lambda w, x: (jax.vmap(lambda xi: stage_fn(xi, w))(x) * r_res).sum(), argnums=(0, 1)),
        compiler_options=once,
    )
    ref_loss, (ref_w, ref_x) = one_device(w_res, x_res)
    jobs = [(name, "cond") for name in tables] + [("zb_h1", "masked")]
    for name, mode in jobs:
        t = tables[name]
        args = (pipeline.chunked(w_res, t.n_chunks), x_res, r_res)
        compiled = pipeline_ops.build_step(stage_mesh, STAGE, t, stage_fn, mode=mode).lower(*args).compile(once)
        loss_, g_, dx_, trace_ = compiled(*args)
        worst = max(
            scaled(abs(float(loss_ - ref_loss)), ref_loss),
            scaled(float(jnp.abs(pipeline.unchunked(g_)["w"] - ref_w["w"]).max()), ref_w["w"]),
            scaled(float(jnp.abs(dx_ - ref_x).max()), ref_x),
        )
        trace_ = np.asarray(trace_)  # [T, 3, p]: operation, micro-batch, chunk of every device at every tick
        assert (trace_[:, 0] == t.op).all() and (trace_[:, 1] == t.mb).all(), "the run is the table"
        assert worst < tol(1e-10), (name, mode, worst)
        op_runs[name, mode], op_traces[name] = (compiled, args), trace_
print(
    f"{DTYPE.__name__} on {p} stage(s) vs one device: loss, weight and input gradients within {tol(1e-10):.0e}"
    f"{'' if F64 else ' (relative)'} for " + ", ".join(f"{n} ({md})" for n, md in op_runs)
)
fig, axes = plt.subplots(len(tables), 1, figsize=(13, (0.42 * p + 1.0) * len(tables)))
for ax, (name, t) in zip(np.atleast_1d(axes), tables.items(), strict=True):
    drawn = pipeline_diagrams.op_trace(op_traces[name])
    bubble = op_schedules.measured_bubble(drawn["op"])
    pipeline_diagrams.ops(
        drawn,
        ax=ax,
        n_chunks=t.n_chunks,
        title=f"{name} as run on {p} device(s): {t.ticks} ticks, bubble {bubble:.1%} measured, "
        f"{op_schedules.predicted_bubble(name, p, m, t.n_chunks):.1%} predicted",
    )
fig.tight_layout()
plt.show()"""

MEM_MD = r"""**Memory held, from the compiled program.** The executor keeps one slot per input a stage holds
(`pipeline_ops.plan`: from its arrival to its last reader) and, for ZB-H1, one per cotangent waiting for
its W. ZB-H1 defers up to `s` W's on stage `s`, and still holds at most `p` micro-batches, 1F1B's peak
(the table above). XLA:CPU's `memory_analysis()` of the ZB-H1 step at `m` and at `2m` micro-batches: its
slots do not grow with `m`, so its temporaries grow by the input cotangents the step returns (`m` more
activations) and not by a stash (which would add `m` activations more: section 5 measured GPipe's)."""

MEM = r"""act_res = int(np.prod(x_res.shape[1:])) * jnp.dtype(DTYPE).itemsize
t2 = op_schedules.zb_h1(p, 2 * m)
plan1, plan2 = pipeline_ops.plan(tables["zb_h1"]), pipeline_ops.plan(t2)
with parity_x64():
    spec = jax.ShapeDtypeStruct((2 * m, *x_res.shape[1:]), DTYPE)
    big = pipeline_ops.build_step(stage_mesh, STAGE, t2, stage_fn, mode="cond")
    temp2 = big.lower(op_runs["zb_h1", "cond"][1][0], spec, spec).compile(once).memory_analysis().temp_size_in_bytes
temp1 = op_runs["zb_h1", "cond"][0].memory_analysis().temp_size_in_bytes
grown, cotangents = temp2 - temp1, m * act_res
print(
    f"ZB-H1 slots (inputs, cotangents) {plan1.n_x, plan1.n_dy} at m={m}, {plan2.n_x, plan2.n_dy} at m={2 * m}; "
    f"temp bytes {temp1:,} -> {temp2:,}: grows {grown:,} = {m} input cotangents ({cotangents:,}) "
    f"{grown - cotangents:+,} (a stash growing with m would add {m * act_res:,} more)"
)
assert (plan2.n_x, plan2.n_dy) == (plan1.n_x, plan1.n_dy) and plan1.n_x <= min(m, p) + 1
if report.platform == "cpu":
    assert abs(grown - cotangents) < m * act_res / 2
else:
    print(f"({report.platform.upper()} places buffers its own way: the slots are counted, the bytes not asserted)")"""

S5C = r"""## 5c · The bubble as waiting

Section 4 timed the **masked** executors: every stage computes every lane some stage uses, and the
mask throws the idle stages' results away. There the bubble is **wasted work**, which the CPU clock sees.
On a pipeline of real devices the bubble is **waiting**: a stage with nothing to do sits idle until the
next tick's `ppermute` brings it something. `pipeline_ops` has both forms of the same tables: `"masked"`
(every operation used at a tick, on every device, `jnp.where` keeps its own) and `"cond"` (`lax.switch` on
the device's own operation: an idle tick computes nothing, a device runs only its own cell). Their compiled
programs differ as predicted: per device, the masked step computes `pipeline_ops.work(...)["masked"]`
FLOPs, the switched one only its own cells, `["useful"]` (the FLOPs of each operation compiled alone,
`pipeline_ops.op_flops`).

**What is measured here, labelled:** the CPU time of the masked and of the switched step (this process's
threads, `time.process_time`): their ratio should follow the predicted work ratio; the assert leaves wide
margins for a loaded machine. Wall time is printed too, but not asserted: the simulated devices are
threads that share this machine's cores, so a device that waits does not leave a core idle here.
**What a real accelerator shows** (one chip per stage, not measured here): the switched step's devices are
busy only in their own cells and *wait* through the rest; each tick lasts as long as its slowest cell, so
the step takes the table's ticks, and each device is idle for the bubble fraction of it — the same fraction
the masked form wastes as work. Skipping the idle work saves power and FLOPs, not time."""

WAIT = r"""import os

calls = {
    f"{name} {mode}": (lambda c=c, a=a: c(*a)) for (name, mode), (c, a) in op_runs.items() if name == "zb_h1"
}
with parity_x64():
    # FLOPs of one cell of each operation (a device's 4 layers), each compiled alone; the masked and the
    # switched ZB-H1 step (the schedule with the most masked work), timed side by side
    costs = pipeline_ops.op_flops(stage_fn, {"w": w_res["w"][:4]}, x_res[0])
    for call in calls.values():  # warm-up
        jax.block_until_ready(call())
    cpu, wall = {k: [] for k in calls}, {k: [] for k in calls}
    for _ in range(3):  # round-robin: a load that changes falls on every program alike
        for k, call in calls.items():
            c0, w0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(call())
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
print(f"{p} simulated device(s) on {os.cpu_count()} core(s) of {report.platform.upper()}; medians, ms per step")
cells = pipeline_ops.work(tables["zb_h1"], costs)
predicted = cells["masked"] / cells["useful"]
ratio = pipeline_measure.median_ratio(cpu, "zb_h1 masked", "zb_h1 cond")
print(
    f"zb_h1 CPU time masked {1e3 * np.median(cpu['zb_h1 masked']):.1f}, switched "
    f"{1e3 * np.median(cpu['zb_h1 cond']):.1f}: masked/switched {ratio:.2f} (predicted work ratio {predicted:.2f})\n"
    f"      wall time masked {1e3 * np.median(wall['zb_h1 masked']):.1f}, switched "
    f"{1e3 * np.median(wall['zb_h1 cond']):.1f} (threads sharing cores: not the devices' waiting)"
)
has_cond = [" conditional(" in op_runs["zb_h1", md][0].as_text() for md in ("cond", "masked")]
print(f"HLO conditional in the switched program {has_cond[0]}, in the masked one {has_cond[1]}")
if report.platform == "cpu":  # observed on XLA:CPU (another compiler may turn a small branch into a select)
    assert has_cond == [True, False]
if predicted >= 1.3:  # wide margins: a loaded machine moves CPU times by tens of per cent
    assert 1 + (predicted - 1) / 3 < ratio < 2 * predicted, (ratio, predicted)
print("on an accelerator (one chip per stage), from each run's trace:")
for name, t in tables.items():
    busy = (op_traces[name][:, 0] != 0).sum(0)  # cells each device ran
    waiting = 1 - busy.mean() / t.ticks
    print(
        f"  {name:11s} each device busy {busy.tolist()} of {t.ticks} ticks: waiting {waiting:.1%} of the step "
        f"(the bubble, {op_schedules.predicted_bubble(name, p, m, t.n_chunks):.1%} predicted)"
    )
    assert abs(waiting - op_schedules.predicted_bubble(name, p, m, t.n_chunks)) < 1e-12"""


def cell(kind, cid, text):
    c = {"cell_type": kind, "id": cid, "metadata": {}, "source": text.splitlines(keepends=True)}
    if kind == "code":
        c.update(execution_count=None, outputs=[])
    return c


EDITS = {  # earlier cells of the pipeline sections that pointed at schedules not run before 5b
    "s3": ("which keeps the smaller bubble and bounds the stash; it is not implemented here.)",
           "which keeps the smaller bubble and bounds the stash; section 5b runs it.)"),
    "s4c": ("The waiting shows in\nwall time on devices that run in parallel, one core or chip each "
            "(not measured here).",
            "The waiting shows in wall time on devices that run in parallel, one core or chip each; section 5c "
            "runs the switched executor beside the masked one."),
    "s5": ("and so holds `p`; that schedule is not run here.)",
           "and so holds `p` at most; section 5b runs it, one operation per tick.)"),
}  # fmt: skip


def main() -> int:
    nb = json.loads(NB.read_text())
    ids = [c["id"] for c in nb["cells"]]
    if "s5b" in ids:
        print("already inserted")
        return 1
    at = ids.index("memory") + 1
    new = [
        cell("markdown", "s5b", S5B),
        cell("code", "op-tables", TABLES),
        cell("markdown", "breadth-md", BREADTH_MD),
        cell("code", "breadth", BREADTH),
        cell("markdown", "op-runs-md", RUNS_MD),
        cell("code", "op-runs", RUNS),
        cell("markdown", "op-memory-md", MEM_MD),
        cell("code", "op-memory", MEM),
        cell("markdown", "s5c", S5C),
        cell("code", "op-waiting", WAIT),
    ]
    nb["cells"][at:at] = new
    for c in nb["cells"]:
        if c["id"] in EDITS:
            old, new_text = EDITS[c["id"]]
            text = "".join(c["source"])
            assert old in text, (c["id"], old)
            c["source"] = text.replace(old, new_text).splitlines(keepends=True)
    NB.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
