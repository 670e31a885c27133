"""The walk-then-copy token task: its structure, its shardings, its bad inputs."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import tokens
from course_lib.meshes import data_mesh

TASK = tokens.CopyWalk(vocab=16, seq_len=16)


def test_targets_are_the_inputs_shifted_and_the_second_half_copies_the_first():
    x, y = (np.asarray(a) for a in TASK.batch(jax.random.key(0), 8))
    assert x.shape == y.shape == (8, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    seq = np.concatenate([x, y[:, -1:]], axis=1)  # [B, S + 1]
    h = TASK.half
    steps = (seq[:, 1 : h + 1] - seq[:, :h]) % TASK.vocab
    assert set(np.unique(steps)) <= set(TASK.steps)
    np.testing.assert_array_equal(seq[:, h + 1 :], seq[:, : 16 - h])
    # the copy mask marks exactly the targets that repeat an earlier token's successor
    mask = np.asarray(TASK.copy_mask())
    assert mask.sum() == 16 - h and not mask[:h].any()


def test_any_sharding_gives_the_same_tokens(report):
    mesh = data_mesh(report.devices, axis_type="auto")
    ref = TASK.batch(jax.random.key(1), 16)
    got = TASK.batch(jax.random.key(1), 16, NamedSharding(mesh, P("data")))
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)  # integers: exact on any CPU


def test_walk_entropy():
    assert TASK.walk_entropy() == pytest.approx(0.8979, abs=1e-4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": 15}, "even integer"),
        ({"vocab": 5}, "at least 7"),
        ({"probs": (0.5, 0.5)}, "one probability"),
    ],
)
def test_bad_tasks_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tokens.CopyWalk(**kwargs)


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size=0"):
        TASK.batch(jax.random.key(0), 0)
