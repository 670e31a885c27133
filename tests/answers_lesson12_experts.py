"""Answers to lab 12's exercise 3 (``ep_dp``'s all-to-all time over the expert axis) for
``tests/test_checks_lesson12.py``: the reference, another correct form, plausible wrong ones and one that
reads the library."""

from course_lib import costs, lm_costs, lm_experts, moe  # noqa: F401  (lm_costs first: imports)


def _seconds(cfg, global_batch, sizes, fabric, capacity_factor, *, itemsize=2, share=True,
             per_layer=4, whole_batch=False, top_k=None):  # fmt: skip
    n_e = sizes["expert"]
    sequences = global_batch if whole_batch else global_batch // (sizes["data"] * n_e)
    cap = moe.capacity(
        sequences * cfg.seq_len, lm_experts.N_EXPERTS, top_k or lm_experts.TOP_K, capacity_factor
    )
    buffer = lm_experts.N_EXPERTS * cap * cfg.d_model * itemsize
    link = fabric.link_of("expert")
    sent = (n_e - 1) / n_e * buffer if share else buffer
    one = (n_e - 1) * link.latency_s + sent / link.bytes_per_s
    return per_layer * cfg.n_layers * one


def reference(cfg, global_batch, sizes, fabric, capacity_factor):
    """The reference: the device's tokens, its capacity, the [E, C, D] bfloat16 buffer; 4 per layer."""
    return _seconds(cfg, global_batch, sizes, fabric, capacity_factor)


def by_collective_time(cfg, global_batch, sizes, fabric, capacity_factor):
    """Another correct form: the course's costs.collective_time on the buffer, once per all-to-all."""
    tokens = global_batch * cfg.seq_len // (sizes["data"] * sizes["expert"])
    cap = moe.capacity(tokens, lm_experts.N_EXPERTS, lm_experts.TOP_K, capacity_factor)
    size = lm_experts.N_EXPERTS * cap * cfg.d_model * 2
    link = fabric.link_of("expert")
    return sum(
        costs.collective_time("all-to-all", sizes["expert"], size, link)
        for _ in range(4 * cfg.n_layers)
    )


def float32(*args):
    """Wrong: 4 bytes a value (float32), not bfloat16's 2."""
    return _seconds(*args, itemsize=4)


def whole_buffer(*args):
    """Wrong: every device sends its whole buffer (the (n_e - 1)/n_e forgotten)."""
    return _seconds(*args, share=False)


def two_per_layer(*args):
    """Wrong: dispatch and return forward only, 2 all-to-alls per layer (the backward's forgotten)."""
    return _seconds(*args, per_layer=2)


def whole_batch_capacity(*args):
    """Wrong: the capacity of the whole batch's tokens, not of the tokens one device routes."""
    return _seconds(*args, whole_batch=True)


def top_one(*args):
    """Wrong: the capacity of top-1 routing, each token one place, not TOP_K."""
    return _seconds(*args, top_k=1)


def in_milliseconds(*args):
    """Wrong: the right time in milliseconds."""
    return 1e3 * reference(*args)


def by_the_library(cfg, global_batch, sizes, fabric, capacity_factor):
    """Refused: reads the library's predicted transfers."""
    transfers = lm_experts.predict_bytes(
        cfg, global_batch, sizes, itemsize=2, capacity_factor=capacity_factor
    )
    return sum(
        costs.collective_time(t.kind, t.group_size, t.size_bytes, fabric.link_of(t.axis))
        for t in transfers
        if t.kind == "all-to-all"
    )


def by_the_step_time(cfg, global_batch, sizes, fabric, capacity_factor):
    """Refused: reads the library's step time (its critical_s is the all-to-alls' time)."""
    n = sizes["data"] * sizes["expert"]
    return lm_experts.step_time(cfg, global_batch, fabric, n, capacity_factor=capacity_factor)[
        "critical_s"
    ]
