"""Exercise checkers of lesson 07 (course_tools.checks.lesson07): each accepts the reference answer and
rejects typical wrong ones with a specific hint (8 simulated CPU devices, from conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_tools.checks import ExerciseError, lesson07


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def _poly_body(x, degree):
    out = jnp.zeros_like(x)
    for k in range(degree + 1):
        out = out + x**k
    return out


def test_static_poly():
    assert lesson07.check_static_poly(jax.jit(_poly_body, static_argnames="degree"))
    rejects(lesson07.check_static_poly, jax.jit(_poly_body), match="static_argnames='degree'")
    rejects(lesson07.check_static_poly, _poly_body, match="not jit-compiled")
    rejects(
        lesson07.check_static_poly, jax.jit(_poly_body, static_argnums=(0, 1)), match="not hashable"
    )


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_donating_update():
    assert lesson07.check_donating_update(jax.jit(_sgd, donate_argnums=0))
    rejects(lesson07.check_donating_update, jax.jit(_sgd), match="donate_argnums=0")
    rejects(
        lesson07.check_donating_update,
        jax.jit(_sgd, donate_argnums=1),
        match="donated the gradients",
    )
    rejects(lesson07.check_donating_update, _sgd, match="not jit-compiled")


def test_balance():
    def good(lengths, n_shards):
        order = np.argsort(lengths)[::-1]
        return np.concatenate([order[s::n_shards] for s in range(n_shards)])

    assert lesson07.check_balance(good)
    rejects(lesson07.check_balance, lambda lengths, n: np.argsort(lengths), match="round-robin")
    rejects(lesson07.check_balance, lambda lengths, n: np.arange(len(lengths)), match="round-robin")
    rejects(lesson07.check_balance, lambda lengths, n: np.sort(lengths), match="not a permutation")


# ---- the student version's stubs are rejected with a plain "not written yet" ------------------------------


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


@pytest.mark.parametrize(
    "check, needs_devices",
    [
        (lesson07.check_balance, False),
    ],
)
def test_stub_is_not_written_yet(report, check, needs_devices):
    args = (_stub, report.devices) if needs_devices else (_stub,)
    rejects(check, *args, match="not written yet")
