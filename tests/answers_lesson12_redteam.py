"""Wrong answers to lab 12's exercises 2, 4 and 5 that an earlier version of the checkers accepted (a red
team's repro), for ``tests/test_checks_lesson12_redteam.py``: each says what it gets wrong."""

from __future__ import annotations

import answers_lesson12 as lab12

from course_lib import costs, lm_costs, lm_layouts, transformer


def _transfers(key, cfg, global_batch):
    sizes = lm_layouts.mesh_axes(key, 16)
    m = 4 * sizes.get("stage", 1)
    return sizes, lm_costs.predict_bytes(key, cfg, global_batch, sizes, itemsize=2, n_micro=m)


def _time(transfers, two_tier, link_of=None):
    link_of = link_of or two_tier.link_of
    return sum(
        costs.collective_time(t.kind, t.group_size, t.size_bytes, link_of(t.axis))
        for t in transfers
    )


def _fastest(times):
    best = min(times, key=times.get)
    return best, times[best]


# ---- exercise 4 ----


def across_rule_of_thumb(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: the axis hard-coded (pipeline: stage; TP layouts: model up to batch 16, else the first)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    tp = layout_key in ("tp_sp", "fsdp_tp", "3d") and global_batch <= 16
    axis = "stage" if layout_key == "pp_dp" else "model" if tp else next(iter(sizes))
    return axis, _time(transfers, fabric.with_axis(axis, inter_link))


def across_h100_ib_hardcoded(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: ignores ``fabric`` and ``inter_link`` (the notebook's H100 and InfiniBand always)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    h100, ib = costs.FABRICS["H100"], costs.LINKS["InfiniBand NDR"]
    return _fastest({a: _time(transfers, h100.with_axis(a, ib)) for a in sizes})


def across_h100_hardcoded(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: ignores ``fabric`` (NVLink 4 inside every node, also a TPU slice's ICI)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    h100 = costs.FABRICS["H100"]
    return _fastest({a: _time(transfers, h100.with_axis(a, inter_link)) for a in sizes})


def across_ib_hardcoded(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: ignores ``inter_link`` (InfiniBand always, also between TPU slices on the DCN)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    ib = costs.LINKS["InfiniBand NDR"]
    return _fastest({a: _time(transfers, fabric.with_axis(a, ib)) for a in sizes})


def across_group_first_axis(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: a group ``"data,model"`` runs on the link of its first axis only."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {}
    for a in sizes:
        two_tier = fabric.with_axis(a, inter_link)
        times[a] = _time(transfers, two_tier, lambda ax, tt=two_tier: tt.link_of(ax.split(",")[0]))
    return _fastest(times)


def across_switch_formula_on_a_ring(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: a hand-written switch formula on every link, also on a TPU slice's ring (which sends both
    ways: half the time)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)

    def seconds(t, link):
        n = t.group_size
        if n <= 1:
            return 0.0
        if t.kind == "collective-permute":
            return link.latency_s + t.size_bytes / link.bytes_per_s
        steps, share = (
            (2 * (n - 1), 2 * (n - 1) / n) if t.kind == "all-reduce" else (n - 1, (n - 1) / n)
        )
        return steps * link.latency_s + share * t.size_bytes / link.bytes_per_s

    times = {}
    for a in sizes:
        two_tier = fabric.with_axis(a, inter_link)
        times[a] = sum(seconds(t, two_tier.link_of(t.axis)) for t in transfers)
    return _fastest(times)


# ---- exercise 5 ----

_HIDDEN = ("gradients", "parameters gathered", "loss")


def _step(key, cfg, global_batch, fabric, *, use_max=True, link_default=False, peak=None,
          hidden_max=False, hide=_HIDDEN, six_n=False):  # fmt: skip
    sizes = lm_layouts.mesh_axes(key, 8)
    per_token = 6 * transformer.param_count(cfg) if six_n else 3 * transformer.flops_per_token(cfg)
    compute = (
        per_token * global_batch * cfg.seq_len / 8 / (peak or costs.rate(fabric.chip, "bfloat16"))
    )
    hidden, waits = [], 0.0
    for t in lm_costs.predict_bytes(key, cfg, global_batch, sizes, itemsize=2):
        link = fabric.link if link_default else fabric.link_of(t.axis)
        s = costs.collective_time(t.kind, t.group_size, t.size_bytes, link)
        if t.what.startswith(hide):
            hidden.append(s)
        else:
            waits += s
    h = max(hidden, default=0.0) if hidden_max else sum(hidden)
    return (max(compute, h) if use_max else compute) + waits


def step_no_max(*args):
    """Wrong: the hidden traffic never counted (compute + exposed, no max)."""
    return _step(*args, use_max=False)


def step_fabric_link(*args):
    """Wrong: every axis on ``fabric.link`` (the data axis's InfiniBand ignored)."""
    return _step(*args, link_default=True)


def step_hidden_max(*args):
    """Wrong: the longest hidden collective, not their sum, against the compute."""
    return _step(*args, hidden_max=True)


def step_h100_peak(*args):
    """Wrong: H100's bfloat16 peak whatever the chip."""
    return _step(*args, peak=989.4e12)


def step_gathers_exposed(*args):
    """Wrong: FSDP's gathered parameters added to the step, not hidden."""
    return _step(*args, hide=("gradients", "loss"))


def step_six_n(*args):
    """Wrong: 6 N FLOPs per token (the attention scores left out)."""
    return _step(*args, six_n=True)


# ---- exercise 2 ----


def largest_as_string(*args):
    """Wrong: the count as a string."""
    return str(lab12.largest_model(*args))


def largest_as_float(*args):
    """Wrong: the count as a float (a layer count is a whole number: an int)."""
    return float(lab12.largest_model(*args))


def largest_half_layer_more(*args):
    """Wrong: a fractional count (``int()`` would round it down to the right one)."""
    return lab12.largest_model(*args) + 0.5


def largest_capped_at(cap):
    """Wrong: a search that stops at ``cap`` layers."""

    def largest(*args):
        return min(lab12.largest_model(*args), cap)

    largest.__name__ = f"largest_capped_at_{cap}"
    return largest
