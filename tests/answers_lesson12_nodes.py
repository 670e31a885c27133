"""Answers to lab 12's exercise 4 (``across_nodes``) for ``tests/test_checks_lesson12.py``: the reference,
other correct forms, and plausible wrong ones (each says what it gets wrong)."""

from __future__ import annotations

import dataclasses

from course_lib import costs, lm_costs, lm_layouts


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


def reference(layout_key, cfg, global_batch, fabric, inter_link):
    """The notebook's answer: time every placement, keep the fastest."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {a: _time(transfers, fabric.with_axis(a, inter_link)) for a in sizes}
    best = min(times, key=times.get)
    return best, times[best]


def through_costs_step_time(layout_key, cfg, global_batch, fabric, inter_link):
    """Right: the course's time model with no compute (its communication part), per placement."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {
        a: costs.step_time(0.0, None, transfers, fabric.with_axis(a, inter_link))["comm_s"]
        for a in sizes
    }
    return min(times.items(), key=lambda kv: kv[1])


def latency_left_out(layout_key, cfg, global_batch, fabric, inter_link):
    """Right (bookkeeping): no α at all, bandwidth terms only."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)

    def no_alpha(two_tier):
        return lambda axis: dataclasses.replace(two_tier.link_of(axis), latency_s=0.0)

    times = {}
    for a in sizes:
        two_tier = fabric.with_axis(a, inter_link)
        times[a] = _time(transfers, two_tier, no_alpha(two_tier))
    best = min(times, key=times.get)
    return best, times[best]


def first_axis_across(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: the rule of thumb "TP inside the node" always — the data-like (first) axis crosses, at every
    batch; at a small batch the model axis sends less."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    axis = next(iter(sizes))
    return axis, _time(transfers, fabric.with_axis(axis, inter_link))


def all_on_the_fast_link(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: forgets the slow link — every collective on the fabric's own."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    return next(iter(sizes)), _time(transfers, fabric)


def groups_left_inside(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: only collectives over the crossing axis alone go on the slow link; a group of two axes
    ('data,model') that includes it is left on the fast one."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {}
    for a in sizes:
        times[a] = _time(
            transfers, fabric, lambda axis, a=a: inter_link if axis == a else fabric.link
        )
    best = min(times, key=times.get)
    return best, times[best]


def no_ring_factor(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: each collective sends its whole array once (no 2(n-1)/n, no (n-1)/n)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {}
    for a in sizes:
        two_tier = fabric.with_axis(a, inter_link)
        times[a] = sum(
            two_tier.link_of(t.axis).latency_s + t.size_bytes / two_tier.link_of(t.axis).bytes_per_s
            for t in transfers
        )
    best = min(times, key=times.get)
    return best, times[best]


def busiest_across(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: puts the axis whose placement is slowest across (the most traffic on the slow link)."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {a: _time(transfers, fabric.with_axis(a, inter_link)) for a in sizes}
    worst = max(times, key=times.get)
    return worst, times[worst]


def by_the_library(layout_key, cfg, global_batch, fabric, inter_link):
    """Refused: asks lm_costs.step_time."""
    times = {
        a: sum(
            lm_costs.step_time(layout_key, cfg, global_batch, fabric.with_axis(a, inter_link), 16)[
                "comm_s"
            ].values()
        )
        for a in lm_layouts.mesh_axes(layout_key, 16)
    }
    return min(times.items(), key=lambda kv: kv[1])


def by_group_membership(layout_key, cfg, global_batch, fabric, inter_link):
    """Right (the notebook's form): no ``with_axis``; a collective whose group names the crossing axis runs on
    ``inter_link``, the others on the fabric's own link."""
    sizes, transfers = _transfers(layout_key, cfg, global_batch)
    times = {}
    for a in sizes:
        times[a] = _time(
            transfers,
            fabric,
            lambda axis, a=a: inter_link if a in axis.split(",") else fabric.link_of(axis),
        )
    best = min(times, key=times.get)
    return best, times[best]


def float32_bytes(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong: 4-byte values (float32), not the lab's bfloat16."""
    sizes = lm_layouts.mesh_axes(layout_key, 16)
    m = 4 * sizes.get("stage", 1)
    transfers = lm_costs.predict_bytes(layout_key, cfg, global_batch, sizes, itemsize=4, n_micro=m)
    times = {a: _time(transfers, fabric.with_axis(a, inter_link)) for a in sizes}
    best = min(times, key=times.get)
    return best, times[best]


def groups_inside_best_axis(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong in the time only: the right axis, timed with its groups ('data,model') left on the fast link."""
    axis, _ = reference(layout_key, cfg, global_batch, fabric, inter_link)
    _, transfers = _transfers(layout_key, cfg, global_batch)
    return axis, _time(transfers, fabric, lambda a: inter_link if a == axis else fabric.link_of(a))


def in_milliseconds(layout_key, cfg, global_batch, fabric, inter_link):
    """Wrong unit: the right placement, its time in milliseconds."""
    axis, seconds = reference(layout_key, cfg, global_batch, fabric, inter_link)
    return axis, seconds * 1e3
