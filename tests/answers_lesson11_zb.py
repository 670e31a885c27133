"""Answers to lesson 11's exercise 3 (ZB-H1's orders), right and wrong, for tests/test_checks_lesson11.py."""

from course_lib import op_schedules
from course_lib.op_schedules import B, F, W


def _one_f_one_b(p, m, s, warm=None):
    """Stage ``s``'s 1F1B order of F's and B's: ``p-1-s`` warm-up forwards (or ``warm``), then one F and one
    B in turn."""
    warm = min(m, p - 1 - s if warm is None else warm)
    order = [(F, i) for i in range(warm)]
    for k in range(m):
        order += [(F, warm + k)] if warm + k < m else []
        order.append((B, k))
    return order


def _with_w(p, m, lag, warm=lambda s: None):
    """1F1B's order with the W of micro-batch ``i`` right after the B of micro-batch ``i + lag(s)``, the rest
    at the end."""
    orders = []
    for s in range(p):
        order, d = [], lag(s)
        for op, i in _one_f_one_b(p, m, s, warm(s)):
            order.append((op, i))
            if op == B and i >= d:
                order.append((W, i - d))
        orders.append(order + [(W, i) for i in range(max(0, m - d), m)])
    return orders


def zb_h1_orders(p, m):
    """The reference (the notebook's solution): the W of micro-batch i after the B of micro-batch i + s."""
    orders = []
    for s in range(p):
        warm = min(m, p - 1 - s)  # 1F1B's warm-up forwards
        order = [(F, i) for i in range(warm)]
        for k in range(m):
            if warm + k < m:
                order.append((F, warm + k))
            order.append((B, k))
            if (
                k >= s
            ):  # W of micro-batch k - s: s B's late, just before the F of micro-batch k - s + p
                order.append((W, k - s))
        orders.append(order + [(W, i) for i in range(max(0, m - s), m)])
    return orders


def zb_h1_tail_reversed(p, m):
    """Right: the reference with the W's left for the end run last micro-batch first."""
    orders = []
    for order in zb_h1_orders(p, m):
        k = len(order)
        while k and order[k - 1][0] == W:
            k -= 1
        orders.append(order[:k] + order[k:][::-1])
    return orders


def zb_h1_mirrored(p, m):
    """Right: the reference with the micro-batches taken last first (the labels are only names)."""
    return [[(op, m - 1 - i) for op, i in order] for order in zb_h1_orders(p, m)]


def fused_1f1b(p, m):
    """Wrong: 1F1B's fused order, B's and no W."""
    return [_one_f_one_b(p, m, s) for s in range(p)]


def w_at_end(p, m):
    """Wrong: 1F1B's order, then every W: the bubble is ZB-H1's, but a stage holds all m micro-batches."""
    return [_one_f_one_b(p, m, s) + [(W, i) for i in range(m)] for s in range(p)]


def w_before_b(p, m):
    """Wrong: the W of micro-batch i just before its B."""
    orders = []
    for order in zb_h1_orders(p, m):
        order = [x for x in order if x[0] != W]
        orders.append([y for op, i in order for y in ([(W, i), (B, i)] if op == B else [(op, i)])])
    return orders


def gpipe_like(p, m):
    """Wrong: every F first, then each B with its W (GPipe's order): a larger bubble, and m held."""
    return [[(F, i) for i in range(m)] + [x for i in range(m) for x in ((B, i), (W, i))]] * p


def eager_w(p, m):
    """Wrong: each W right after its B: the B's that the previous stage waits for come later."""
    return _with_w(p, m, lambda s: 0)


def w_one_late(p, m):
    """Wrong: the W of micro-batch i after the B of micro-batch i + s + 1, one B too late: p + 1 held."""
    return _with_w(p, m, lambda s: s + 1)


def w_late_by_one(p, m):
    """Wrong: the W of micro-batch i just before the F of micro-batch i + p + 1 (where there is one), one F
    too late: ZB-H1's bubble, but p + 1 micro-batches held once m >= p + 2."""
    orders = []
    for order in zb_h1_orders(p, m):
        order = [x for x in order if not (x[0] == W and x[1] + p + 1 < m)]
        out = []
        for op, i in order:
            if op == F and i >= p + 1:
                out.append((W, i - p - 1))
            out.append((op, i))
        orders.append(out)
    return orders


def warm_up_reversed(p, m):
    """Wrong: stage s runs s warm-up forwards instead of p-1-s: stage 0 waits for a B before sending the
    forward the last stage waits for."""
    return _with_w(p, m, lambda s: s, warm=lambda s: s)


def named_ops(p, m):
    """Wrong: the ops as letters, not op_schedules' codes."""
    names = {F: "F", B: "B", W: "W"}
    return [[(names[op], i) for op, i in order] for order in zb_h1_orders(p, m)]


def from_the_table(p, m):
    """Refused: reads the orders off the library's ZB-H1 table."""
    t = op_schedules.zb_h1(p, m)
    return [
        [(int(o), int(i)) for o, i in zip(t.op[:, s], t.mb[:, s], strict=True) if o]
        for s in range(p)
    ]


def from_make(p, m):
    """Refused: the same through ``make``."""
    t = op_schedules.make("zb_h1", p, m)
    return [
        [(int(o), int(i)) for o, i in zip(t.op[:, s], t.mb[:, s], strict=True) if o]
        for s in range(p)
    ]
