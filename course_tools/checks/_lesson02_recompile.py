"""Lesson 02, exercise 1: why does this recompile? Nine snippets, three "training steps" each.

Each snippet runs in a fresh scope holding :data:`RECOMPILE_SETUP`; the compiles of the functions it
jits are counted with ``course_lib.programs.CompileLog`` (eager operations, which compile too, are left
out by name).
"""

from __future__ import annotations

RECOMPILE_SETUP = """\
def step(v, cfg):            # cfg is a static argument where step is jitted with static_argnums=1
    return v * cfg.scale

def double(v):
    return 2 * v

@dataclasses.dataclass(frozen=True)
class Frozen:                # frozen: hashed and compared by its fields
    scale: float = 2.0

@dataclasses.dataclass
class Plain:                 # the default dataclass
    scale: float = 2.0

@dataclasses.dataclass(eq=False)
class Config:                # eq=False: compared (and hashed) as object identity
    scale: float = 2.0

class Model:
    def __init__(self):
        self.scale = 2.0

    def apply(self, v):
        return v * self.scale

x = jnp.arange(4.0)
"""
"""What every snippet of :data:`RECOMPILE_CASES` can use (the notebook prints it)."""

RECOMPILE_CASES = {
    "config object": "f = jax.jit(step, static_argnums=1)\nfor _ in range(3):\n    f(x, Config())",
    "plain dataclass config": "f = jax.jit(step, static_argnums=1)\nfor _ in range(3):\n    f(x, Plain())",
    "frozen config": "f = jax.jit(step, static_argnums=1)\nfor _ in range(3):\n    f(x, Frozen())",
    "jit in the loop": "for _ in range(3):\n    jax.jit(double)(x)",
    "jit of a lambda in the loop": "for _ in range(3):\n    jax.jit(lambda v: double(v))(x)",
    "partial in the loop": "for _ in range(3):\n    jax.jit(functools.partial(step, cfg=Frozen()))(x)",
    "bound method": "model = Model()\nfor _ in range(3):\n    jax.jit(model.apply)(x)",
    "closed-over array": "w = jnp.ones(4)\nf = jax.jit(lambda v: v * w)\nfor _ in range(3):\n"
    "    f(x)\n    w = w + 1",
    "keyword, then position": "f = jax.jit(step, static_argnames='cfg')\nfor _ in range(2):\n"
    "    f(x, cfg=Frozen())\nf(x, Frozen())",
}
"""Snippets whose number of compiles the learner predicts (an int, or "error" if the snippet raises)."""

COUNTED = ("jit(step)", "jit(double)", "jit(<lambda>)", "jit(apply)")
"""The programs counted: the snippets' own jitted functions, not the eager operations around them."""


def measure_recompiles() -> dict[str, int | str]:
    """Run each snippet of :data:`RECOMPILE_CASES` in a fresh scope; its compiles, or ``"error"``."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from course_lib.programs import CompileLog

    counts: dict[str, int | str] = {}
    for name, code in RECOMPILE_CASES.items():
        scope = {"jax": jax, "jnp": jnp, "dataclasses": dataclasses, "functools": functools}
        exec(RECOMPILE_SETUP, scope)
        try:
            with CompileLog() as log:
                exec(code, scope)
                jax.effects_barrier()
        except Exception:  # noqa: BLE001 - a snippet that raises is predicted as "error"
            counts[name] = "error"
            continue
        counts[name] = sum(c in COUNTED for c in log.compiled)
    return counts
