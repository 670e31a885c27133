"""Answers to the exercises of lesson 12, right and wrong, for tests/test_checks_lesson12.py."""

import dataclasses
import sys
import types
from concurrent.futures import ThreadPoolExecutor

# ---- exercise 4: which axis crosses the nodes (tests/answers_lesson12_nodes.py) ---------------------------
from answers_lesson12_nodes import by_the_library
from answers_lesson12_nodes import reference as across_nodes

from course_lib import lm_costs, lm_layouts, transformer


def across_in_a_thread(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: the library's step time, asked from a thread pool (a profile hook sees only its own thread)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(
            by_the_library, layout_key, cfg, global_batch, fabric, inter_link
        ).result()


def _by_the_library(layout_key, cfg, global_batch, fabric, inter_link):
    times = {}
    for axis in lm_layouts.mesh_axes(layout_key, 16):
        row = _step_time_copy(layout_key, cfg, global_batch, fabric.with_axis(axis, inter_link), 16)
        times[axis] = sum(row["comm_s"].values())
    return min(times.items(), key=lambda kv: kv[1])


def across_by_code_copy(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: the model's ``step_time`` run as a copy of its code under another name, made at import."""
    return _by_the_library(layout_key, cfg, global_batch, fabric, inter_link)


_step_time_copy = types.FunctionType(
    lm_costs.step_time.__code__.replace(co_name="mine"), lm_costs.step_time.__globals__, "mine",
    lm_costs.step_time.__defaults__,
)  # fmt: skip
_step_time_copy.__kwdefaults__ = lm_costs.step_time.__kwdefaults__


def across_without_the_hook(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: switches the profile hook off, then answers by the reference."""
    sys.setprofile(None)
    return across_nodes(layout_key, cfg, global_batch, fabric, inter_link)


def largest_in_a_thread(layout_key, cfg, global_batch, memory_limit):
    """Wrong: ``largest_layers`` run in a thread pool."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(largest_by_lookup, layout_key, cfg, global_batch, memory_limit).result()


# ---- exercise 2: the largest model that fits ---------------------------------------------------------------


def _mem_at(
    key, cfg, global_batch, n_layers, kinds=("params", "optimizer", "gradients", "activations")
):
    sizes = lm_layouts.mesh_axes(key, 8)
    p = sizes.get("stage", 1)
    m = 4 * p if p > 1 else 1
    mem = lm_costs.predict_memory(
        key, dataclasses.replace(cfg, n_layers=n_layers), global_batch, sizes, 2, m
    )
    return sum(mem[k] for k in kinds), p


def largest_model(layout_key, cfg, global_batch, memory_limit):
    """The reference: memory is linear in the layers; solve for the largest multiple of the stages."""
    at_one, p = _mem_at(
        layout_key, cfg, global_batch, lm_layouts.mesh_axes(layout_key, 8).get("stage", 1)
    )
    at_two, _ = _mem_at(layout_key, cfg, global_batch, 2 * p)
    if at_one > memory_limit:
        return 0
    return p * (1 + int((memory_limit - at_one) // (at_two - at_one)))


def largest_model_search(layout_key, cfg, global_batch, memory_limit):
    """Another correct form: count up a stage at a time until the next one does not fit."""
    p = lm_layouts.mesh_axes(layout_key, 8).get("stage", 1)
    n = 0
    while _mem_at(layout_key, cfg, global_batch, n + p)[0] <= memory_limit:
        n += p
    return n


def largest_float32(layout_key, cfg, global_batch, memory_limit):
    """Wrong: every value held in 4 bytes (the lab holds bfloat16)."""
    return largest_model(layout_key, cfg, global_batch, memory_limit / 2)


def largest_four_micro_batches(layout_key, cfg, global_batch, memory_limit):
    """Wrong: the pipeline's "4 micro-batches per stage" read as 4 in all (the lab runs 4 x stages)."""
    if layout_key != "pp_dp":
        return largest_model(layout_key, cfg, global_batch, memory_limit)
    sizes, n = lm_layouts.mesh_axes(layout_key, 8), 0
    while True:
        nxt = dataclasses.replace(cfg, n_layers=n + sizes["stage"])
        mem = lm_costs.predict_memory(layout_key, nxt, global_batch, sizes, 2, 4)
        if sum(mem[k] for k in ("params", "optimizer", "gradients", "activations")) > memory_limit:
            return n
        n += sizes["stage"]


def largest_no_optimizer(layout_key, cfg, global_batch, memory_limit):
    """Wrong: forgets the optimizer state."""
    p = lm_layouts.mesh_axes(layout_key, 8).get("stage", 1)
    n = 0
    while (
        _mem_at(layout_key, cfg, global_batch, n + p, ("params", "gradients", "activations"))[0]
        <= memory_limit
    ):
        n += p
    return n


def largest_any_count(layout_key, cfg, global_batch, memory_limit):
    """Wrong: ignores that a pipeline's layers split over its stages (one layer at a time)."""
    n = 0
    while n < 4096 and _mem_at(layout_key, cfg, global_batch, n + 1)[0] <= memory_limit:
        n += 1
    return n


def largest_off_by_one(layout_key, cfg, global_batch, memory_limit):
    """Wrong: returns the first count that does not fit."""
    return largest_model_search(layout_key, cfg, global_batch, memory_limit) + lm_layouts.mesh_axes(
        layout_key, 8
    ).get("stage", 1)


def largest_limit_as_gib(layout_key, cfg, global_batch, memory_limit):
    """Wrong: the memory counted in GiB against the limit's GB figure (``memory_limit / 1e9`` read as GiB)."""
    p = lm_layouts.mesh_axes(layout_key, 8).get("stage", 1)
    n = 0
    while _mem_at(layout_key, cfg, global_batch, n + p)[0] / 2**30 <= memory_limit / 1e9:
        n += p
    return n


def largest_per_device_batch(layout_key, cfg, global_batch, memory_limit):
    """Wrong: passes the per-device batch (global / 8) where the memory model takes the global batch (and
    splits it itself): the activations of an eighth of the batch."""
    p = lm_layouts.mesh_axes(layout_key, 8).get("stage", 1)
    n = 0
    batch = global_batch if p > 1 else global_batch // 8  # (the pipeline's would not split)
    while _mem_at(layout_key, cfg, batch, n + p)[0] <= memory_limit:
        n += p
        if n > 4096:
            break
    return n


def largest_by_lookup(layout_key, cfg, global_batch, memory_limit):
    """Wrong: reads the memory model's answer instead of counting."""
    return lm_costs.largest_layers(layout_key, cfg, global_batch, memory_limit)


def largest_gpu_always(layout_key, cfg, global_batch, memory_limit):
    """Wrong: the GPU configuration's width whatever ``cfg`` is (right for the notebook's own calls)."""
    return largest_model(layout_key, transformer.GPU, global_batch, memory_limit)


def largest_below_limit(layout_key, cfg, global_batch, memory_limit):
    """Wrong: ``<`` for "at most": a count whose memory equals the limit left out."""
    p = lm_layouts.mesh_axes(layout_key, 8).get("stage", 1)
    n = 0
    while _mem_at(layout_key, cfg, global_batch, n + p)[0] < memory_limit:
        n += p
    return n


def largest_by_line(layout_key, cfg, global_batch, memory_limit):
    """Wrong: a line through 1 and 2 layers whatever the stages, and no floor at 0 (negative when not even
    the embeddings fit)."""
    at_one, _ = _mem_at(layout_key, cfg, global_batch, 1)
    at_two, _ = _mem_at(layout_key, cfg, global_batch, 2)
    return 1 + int((memory_limit - at_one) // (at_two - at_one))


# ---- exercise 1: the pipeline's bytes -----------------------------------------------------------------------


def _pipeline(
    n_stages,
    n_data,
    n_micro,
    cfg,
    global_batch,
    itemsize,
    sends=None,
    mean=True,
    ring=True,
    rest_in_data=True,
):
    p, d = n_stages, n_data
    act = global_batch // d // n_micro * cfg.seq_len * cfg.d_model * itemsize
    k = 2 * (n_micro + p - 2) if sends is None else sends(n_micro, p)
    stage = k * act * ((p - 1) / p if mean else 1.0) if p > 1 else 0.0
    rest = (2 * cfg.vocab * cfg.d_model + cfg.seq_len * cfg.d_model + 2 * cfg.d_model) * itemsize
    per_layer = transformer.param_count(dataclasses.replace(cfg, n_layers=1)) - rest // itemsize
    blocks = cfg.n_layers // p * per_layer * itemsize
    f = (lambda n: 2 * (n - 1) / n) if ring else (lambda n: (n - 1) / n)
    data = f(d) * (blocks + (rest if rest_in_data else 0) + itemsize)
    return {"stage": stage + f(p) * (rest + itemsize), "data": data}


def pipeline_bytes(n_stages, n_data, n_micro, cfg, global_batch, itemsize):
    """The reference."""
    return _pipeline(n_stages, n_data, n_micro, cfg, global_batch, itemsize)


def pipeline_bytes_by_parts(n_stages, n_data, n_micro, cfg, global_batch, itemsize):
    """Another correct form: from lm_layouts' parameter bytes and comms.ring_bytes, one send at a time."""
    from course_lib import comms

    sizes = {"data": n_data, "stage": n_stages}
    local = lm_costs.param_bytes("pp_dp", cfg, sizes, itemsize)
    rest = lm_costs.param_bytes(
        "pp_dp", cfg, sizes, itemsize, lambda names, spec: names[0] != "blocks"
    )
    act = global_batch // n_data // n_micro * cfg.seq_len * cfg.d_model * itemsize
    stage = 0.0
    for _ in range(2 * (n_micro + n_stages - 2)):
        stage += act * (n_stages - 1) / n_stages
    stage += comms.ring_bytes("all-reduce", rest + itemsize, n_stages)
    return {"stage": stage, "data": comms.ring_bytes("all-reduce", local + itemsize, n_data)}


def pipeline_every_tick(*args):
    """Wrong: a send on every tick (m + p - 1 each way), the last one's result read by no one."""
    return _pipeline(*args, sends=lambda m, p: 2 * (m + p - 1))


def pipeline_forward_only(*args):
    """Wrong: counts the forward sends only."""
    return _pipeline(*args, sends=lambda m, p: m + p - 2)


def pipeline_every_device_sends(*args):
    """Wrong: counts the busiest device's bytes, as if the last stage sent too."""
    return _pipeline(*args, mean=False)


def pipeline_half_ring(*args):
    """Wrong: the all-reduce sends (n-1)/n, forgetting its all-gather half."""
    return _pipeline(*args, ring=False)


def pipeline_by_lookup(n_stages, n_data, n_micro, cfg, global_batch, itemsize):
    """Wrong: reads lm_costs.predict_bytes instead of counting the transfers."""
    from course_lib import comms

    sizes = {"data": n_data, "stage": n_stages}
    got = comms.sent_by_axis(
        lm_costs.predict_bytes(
            "pp_dp", cfg, global_batch, sizes, itemsize=itemsize, n_micro=n_micro
        )
    )
    return {"stage": got.get("stage", 0.0), "data": got.get("data", 0.0)}


def pipeline_no_loss(*args):
    """Wrong: the loss is not all-reduced with the gradients."""
    got = _pipeline(*args)
    n_stages, n_data, itemsize = args[0], args[1], args[5]
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731
    return {
        "stage": got["stage"] - ring(n_stages) * itemsize,
        "data": got["data"] - ring(n_data) * itemsize,
    }


def pipeline_whole_batch(n_stages, n_data, n_micro, cfg, global_batch, itemsize):
    """Wrong: a micro-batch of the global batch, forgetting that the data axis splits it first."""
    return _pipeline(n_stages, 1, n_micro, cfg, global_batch, itemsize) | {
        "data": _pipeline(n_stages, n_data, n_micro, cfg, global_batch, itemsize)["data"]
    }


# ---- exercise 5: a layout's step time, by hand ---------------------------------------------------------------

_HIDDEN = ("gradients", "parameters gathered", "loss")
"""The collectives that hide behind compute (what they carry): the data-parallel traffic."""


def _own_time(t, link, ring_factor=True, alpha=True, ar_steps=2) -> float:
    """A collective's time on a switch (NVLink, InfiniBand): α per ring step + bytes sent / bandwidth."""
    n = t.group_size
    if t.kind == "all-reduce":
        steps, share = ar_steps * (n - 1), 2 * (n - 1) / n
    else:  # all-gather, reduce-scatter: one half of the ring
        steps, share = n - 1, (n - 1) / n
    return (steps * link.latency_s if alpha else 0.0) + t.size_bytes * (
        share if ring_factor else 1.0
    ) / link.bytes_per_s


def _step(
    key, cfg, global_batch, fabric, *, passes=3, ring_factor=True, alpha=True, overlap="data",
    ar_steps=2, bits=1, precision="bfloat16",
):  # fmt: skip
    from course_lib import costs

    sizes = lm_layouts.mesh_axes(key, 8)
    flops = passes * transformer.flops_per_token(cfg) * global_batch * cfg.seq_len / 8
    compute = flops / costs.rate(fabric.chip, precision)
    hidden = critical = 0.0
    for t in lm_costs.predict_bytes(key, cfg, global_batch, sizes, itemsize=2):
        t = dataclasses.replace(t, size_bytes=t.size_bytes * bits)
        seconds = _own_time(t, fabric.link_of(t.axis), ring_factor, alpha, ar_steps)
        if t.what.startswith(_HIDDEN):
            hidden += seconds
        else:
            critical += seconds
    if overlap == "none":
        return compute + hidden + critical
    if overlap == "all":
        return max(compute, hidden + critical)
    return max(compute, hidden) + critical


def predict_step(layout_key, cfg, global_batch, fabric):
    """The reference: FLOPs over the peak; each collective's α and bytes by hand; data traffic hidden."""
    return _step(layout_key, cfg, global_batch, fabric)


def predict_step_by_collective_time(layout_key, cfg, global_batch, fabric):
    """Another correct form: the course's costs.collective_time per transfer, the critical ones by axis."""
    from course_lib import costs

    lay = lm_layouts.layout(layout_key)
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    waits = {lay.model_axis, lay.seq_axis} - {None}
    compute = 3 * transformer.flops_per_token(cfg) * global_batch * cfg.seq_len / 8
    compute /= fabric.chip.bf16 * 1e12
    parts = {True: 0.0, False: 0.0}
    for t in lm_costs.predict_bytes(layout_key, cfg, global_batch, sizes, itemsize=2):
        on_path = t.axis in waits and not t.what.startswith(_HIDDEN)
        link = fabric.link_of(t.axis)
        parts[on_path] += costs.collective_time(t.kind, t.group_size, t.size_bytes, link)
    return max(compute, parts[False]) + parts[True]


def predict_step_by_costs(layout_key, cfg, global_batch, fabric):
    """Another correct form: the course's one time model (costs.step_time) on the hidden traffic, the
    critical collectives added."""
    from course_lib import costs

    sizes = lm_layouts.mesh_axes(layout_key, 8)
    flops = 3 * transformer.flops_per_token(cfg) * global_batch * cfg.seq_len / 8
    transfers = lm_costs.predict_bytes(layout_key, cfg, global_batch, sizes, itemsize=2)
    hidden = [t for t in transfers if t.what.startswith(_HIDDEN)]
    critical = [t for t in transfers if not t.what.startswith(_HIDDEN)]
    overlapped = costs.step_time(flops, None, hidden, fabric)["overlap_s"]
    return overlapped + costs.step_time(0.0, None, critical, fabric)["comm_s"]


def step_forward_only(*args):
    """Wrong: the forward's FLOPs only (the backward's 2× forgotten)."""
    return _step(*args, passes=1)


def step_bytes_once(*args):
    """Wrong: each collective's whole size_bytes crosses the link once (no (n-1)/n or 2(n-1)/n)."""
    return _step(*args, ring_factor=False)


def step_no_latency(*args):
    """Wrong: bandwidth terms only, no α."""
    return _step(*args, alpha=False)


def step_no_overlap(*args):
    """Wrong: every collective added to the compute (overlap not applied)."""
    return _step(*args, overlap="none")


def step_all_hidden(*args):
    """Wrong: everything hidden, TP/SP/CP's collectives too (max of compute and all communication)."""
    return _step(*args, overlap="all")


def step_all_reduce_alpha_once(*args):
    """Wrong: an all-reduce's latency as n-1 steps of α (one half of the ring), not 2(n-1)."""
    return _step(*args, ar_steps=1)


def step_in_bits(*args):
    """Wrong: the collectives' sizes in bits (8 × size_bytes) over a bandwidth in bytes per second."""
    return _step(*args, bits=8)


def step_float32_peak(*args):
    """Wrong: the FLOPs over the chip's float32 peak, not its bfloat16 one."""
    return _step(*args, precision="float32")


def step_in_milliseconds(*args):
    """Wrong: the right step time in milliseconds."""
    return 1e3 * predict_step(*args)


def step_constant(*args):
    """Wrong: one plausible step time (10 ms) whatever the case."""
    return 0.01


def step_by_the_library(layout_key, cfg, global_batch, fabric):
    """Wrong: reads the library's step time."""
    return lm_costs.step_time(
        layout_key, cfg, global_batch, fabric, overlap="data", roofline=False
    )["step_s"]
