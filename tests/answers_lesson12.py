"""Answers to the exercises of lesson 12, right and wrong, for tests/test_checks_lesson12.py."""

import dataclasses

from course_lib import costs, lm_costs, lm_layouts, transformer

# ---- exercise 1: the layout decision ----------------------------------------------------------------------


def _candidates(cfg, global_batch):
    for k in lm_layouts.LAYOUTS:
        sizes = lm_layouts.mesh_axes(k, 8)
        if sizes is not None and lm_costs.splits(k, cfg, global_batch, sizes):
            p = sizes.get("stage", 1)
            yield k, sizes, p, (4 * p if p > 1 else 1)


def _memory(
    k, cfg, global_batch, sizes, m, kinds=("params", "optimizer", "gradients", "activations")
):
    mem = lm_costs.predict_memory(k, cfg, global_batch, sizes, 2, m)
    return sum(mem[kind] for kind in kinds)


def _step(k, cfg, global_batch, sizes, p, m, profile, bubble=True, latency=True):
    flops = 3 * transformer.flops_per_token(cfg) * global_batch * cfg.seq_len / 8
    compute = flops / costs.rate(profile.peak, "bfloat16")
    if bubble and p > 1:
        compute *= (m + p - 1) / m
    sent = lm_costs.predict_bytes(k, cfg, global_batch, sizes, itemsize=2, n_micro=m)
    total = sum(t.sent_bytes for t in sent)
    lat = len(sent) * costs.COLLECTIVE_LATENCY_S if latency else 0.0
    return compute + total / profile.link_bytes_per_s + lat, total


def choose_layout(cfg, global_batch, profile, memory_limit):
    """The reference (the notebook's solution): a loop that keeps the fastest layout that fits."""
    best = None
    for k, sizes, p, m in _candidates(cfg, global_batch):
        memory = _memory(k, cfg, global_batch, sizes, m)
        if memory > memory_limit:
            continue
        step, total = _step(k, cfg, global_batch, sizes, p, m, profile)
        if best is None or step < best[0]:
            best = (step, k, total, memory)
    return best[1], best[2], best[3]


def choose_layout_sorted(cfg, global_batch, profile, memory_limit):
    """Another correct form: a table of every layout, filtered, then sorted; bytes as an int, a list back."""
    table = []
    for k, sizes, p, m in _candidates(cfg, global_batch):
        step, total = _step(k, cfg, global_batch, sizes, p, m, profile)
        table.append(
            {
                "k": k,
                "step": step,
                "sent": int(round(total)),
                "mem": _memory(k, cfg, global_batch, sizes, m),
            }
        )
    fits = sorted((r for r in table if r["mem"] <= memory_limit), key=lambda r: r["step"])
    return [fits[0]["k"], fits[0]["sent"], fits[0]["mem"]]


def _variant(**kw):
    def choose(cfg, global_batch, profile, memory_limit):
        best = None
        for k, sizes, p, m in _candidates(cfg, global_batch):
            memory = _memory(
                k,
                cfg,
                global_batch,
                sizes,
                m,
                kw.get("kinds", ("params", "optimizer", "gradients", "activations")),
            )
            if kw.get("memory_filter", True) and memory > memory_limit:
                continue
            step, total = _step(
                k,
                cfg,
                global_batch,
                sizes,
                p,
                m,
                profile,
                kw.get("bubble", True),
                kw.get("latency", True),
            )
            if kw.get("comm_only"):
                step = total
            if best is None or step < best[0]:
                best = (step, k, total, memory)
        return best[1], best[2], best[3]

    return choose


choose_no_memory_limit = _variant(memory_filter=False)
"""Wrong: ranks every layout, fitting or not."""
choose_no_bubble = _variant(bubble=False)
"""Wrong: the pipeline's bubble is left out (the pipeline looks as fast as DP and sends less)."""
choose_fewest_bytes = _variant(comm_only=True)
"""Wrong: the layout that sends the least, whatever its compute."""
choose_no_activations = _variant(kinds=("params", "optimizer", "gradients"))
"""Wrong: memory without the activations."""


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


# ---- exercise 3: the pipeline's bytes -----------------------------------------------------------------------


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
