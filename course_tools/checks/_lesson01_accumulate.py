"""Lesson 01, exercise 4 (gradient accumulation): the pass log and the value judgement of its checker."""

from __future__ import annotations

import re

import numpy as np

from ._common import close, fail, matmul_rtol


def pass_tap(passes: list):
    """An identity on params whose forward logs "f" and whose backward logs "b" into ``passes``, at run time."""
    import jax

    @jax.custom_vjp
    def tap(params):
        return params

    def forward(params):
        jax.debug.callback(lambda: passes.append("f"))
        return params, None

    def backward(_, cotangent):
        jax.debug.callback(lambda: passes.append("b"))
        return (cotangent,)

    tap.defvjp(forward, backward)
    return tap


def judge_one_at_a_time(order: str, chunks: int) -> None:
    """``order``: the "f"/"b" log of the answer's passes (a checkpoint's recompute repeats an "f"). Right: at
    least ``chunks`` backward passes, each micro-batch's forward pass followed by its backward pass before
    the next forward pass starts ("fb" repeated); smaller micro-batches than ``micro`` are right too."""
    while "ff" in order:
        order = order.replace("ff", "f")
    if order.count("b") < chunks:
        fail(
            f"{order.count('b')} backward pass(es) for {chunks} micro-batches: the micro-batches were "
            "differentiated together (vmap of grad?), so all their activations are alive at once",
            "differentiate one micro-batch, add its gradient into the running sum, then take the next "
            "(a Python loop, lax.scan or lax.fori_loop)",
        )
    if re.fullmatch("(fb)+", order) is None:  # any number of micro-batches of at most micro rows
        fail(
            "a micro-batch's forward pass started before the previous one's backward pass ended "
            "(one grad of a sum of micro-batch losses?): every micro-batch's activations are kept",
            "call jax.value_and_grad(loss_fn) on one micro-batch at a time and add the results",
        )


def judge_accumulated(loss_fn, params, x, y, micro, loss, grads) -> None:
    """The accumulated (loss, grads) against the whole batch's value_and_grad, within the platform's float32
    matmul tolerance (:func:`._common.close`, :func:`._common.matmul_rtol`), or an ExerciseError."""
    import jax

    batch = x.shape[0]
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(
        params, x, y
    )  # the whole batch at once
    chunks = -(-batch // micro)
    leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    rtol = matmul_rtol(1e-4)  # the two sum the rows' matmuls in different orders
    loss_close = np.isclose(float(loss), float(ref_loss), rtol=rtol)
    if loss_close and all(close(g, r, rtol) for g, r in zip(leaves, ref_leaves)):
        return
    if all(close(g, chunks * np.asarray(r), rtol) for g, r in zip(leaves, ref_leaves)):
        fail(
            f"the gradient is {chunks}x the full-batch one ({chunks} micro-batches)",
            "loss_fn is a mean: weight each micro-batch by its share of the rows before adding",
        )
    if batch % micro:
        fail(
            f"batch {batch} in micro-batches of {micro}: the result differs from the full-batch one "
            "(it is right when micro divides the batch)",
            f"the last micro-batch has {batch % micro} rows, not {micro}: weight each micro-batch by "
            f"rows_in_it / {batch}, and do not drop it",
        )
    if not loss_close:
        fail(
            f"loss {float(loss):.5f}, the full batch gives {float(ref_loss):.5f}",
            "accumulate the loss with the same weights as the gradient",
        )
    fail(
        "the gradient differs from the full-batch gradient",
        "each micro-batch's gradient, weighted by its share of rows",
    )
