"""Exercise 1 of lesson 09 (``lesson09.check_process_rows``) on its simulated group: 4 processes x 2 devices
as ``data × model = 2 × 4``, where the three layouts give three different answers whatever the kernel's
device count (the suite runs at 8; ``COURSE_TEST_DEVICES=1`` or ``2`` runs it at 1 or 2 devices, where the
group is the same), and the forms an answer may take: integer pairs, nested pairs, a NumPy integer array of
shape ``(P, 2)``; never a float or a bool."""

import jax
import numpy as np
import pytest
from checking import rejects

from course_tools.checks import lesson09

# process p owns stand-in devices 2p, 2p + 1; rows per device 2, per data index 8
RIGHT = {
    "a": [(0, 4), (4, 8), (8, 12), (12, 16)],  # one data axis over the 8 devices
    "b": [(0, 8), (0, 8), (8, 16), (8, 16)],  # a process's 2 devices share one data index
    "c": [(0, 16)] * 4,  # transposed: a process's 2 devices sit on both data indices
}


def group():
    devices, n_proc, mesh_shape = lesson09.exercise_group()
    return devices, n_proc, 2 * len(devices), mesh_shape


def check(predictions):
    devices, n_proc, B, mesh_shape = group()
    return lesson09.check_process_rows(predictions, devices, n_proc, B, mesh_shape)


def wrong(predictions, match):
    devices, n_proc, B, mesh_shape = group()
    rejects(lesson09.check_process_rows, predictions, devices, n_proc, B, mesh_shape, match=match)


def test_the_group_is_the_same_at_every_device_count():
    devices, n_proc, B, mesh_shape = group()
    assert len(jax.devices()) in (1, 2, 3, 4, 6, 8)  # the kernel's own count plays no part
    assert (n_proc, len(devices), mesh_shape, B) == (4, 8, (2, 4), 16)
    assert [d.process_index for d in devices] == [0, 0, 1, 1, 2, 2, 3, 3]
    measured = {
        k: lesson09.measure_process_rows(k, devices, n_proc, B, mesh_shape)
        for k in lesson09.LAYOUTS
    }
    assert measured == RIGHT
    assert len({str(v) for v in measured.values()}) == 3  # three different answers


def test_right_forms_accepted():
    assert check(RIGHT)
    assert check({k: [list(r) for r in v] for k, v in RIGHT.items()})  # lists
    assert check({k: np.array(v, dtype=np.int64) for k, v in RIGHT.items()})  # (P, 2) arrays
    assert check({k: [tuple(np.int32(x) for x in r) for r in v] for k, v in RIGHT.items()})
    per_device = {  # one pair per device, merged by the check
        **RIGHT,
        "a": [[(4 * p, 4 * p + 2), (4 * p + 2, 4 * p + 4)] for p in range(4)],
        "c": [[(0, 8), (8, 16)]] * 4,
    }
    assert check(per_device)


@pytest.mark.parametrize(
    "answer, how_many",
    [
        ({**RIGHT, "b": RIGHT["a"]}, 1),  # the model axis taken to split the batch as well
        ({**RIGHT, "c": RIGHT["b"]}, 1),  # the transpose ignored
        ({**RIGHT, "b": RIGHT["c"], "c": RIGHT["b"]}, 2),  # b and c swapped
        (dict.fromkeys(lesson09.LAYOUTS, RIGHT["a"]), 2),  # process_rows everywhere
        (dict.fromkeys(lesson09.LAYOUTS, [(0, 16)] * 4), 2),  # every process holds everything
        ({k: [(a, b - 1) for a, b in v] for k, v in RIGHT.items()}, 3),  # stop inclusive
        ({k: v[::-1] for k, v in RIGHT.items()}, 2),  # processes in reverse (c is symmetric)
    ],
)
def test_wrong_rows_refused_without_naming_the_layout(answer, how_many):
    wrong(answer, f"{how_many} of your 3 predictions differ")


@pytest.mark.parametrize(
    "bad, shown",
    [
        ([(0.0, 4.0), (4, 8), (8, 12), (12, 16)], "0.0"),  # flat pair of floats
        ([(0, 4), (4, 8), (8, 12), (12, 16.5)], "16.5"),
        ([[(0, 2.5), (2.5, 4)], (4, 8), (8, 12), (12, 16)], "2.5"),  # nested pairs: never truncated
        ([[(0.0, 4.0)], (4, 8), (8, 12), (12, 16)], "0.0"),
        (np.array(RIGHT["a"], dtype=np.float64), "0.0"),  # a float array
        ([(False, True), (4, 8), (8, 12), (12, 16)], "False"),
    ],
)
def test_non_integer_bounds_refused_by_value(bad, shown):
    wrong({**RIGHT, "a": bad}, f"row bound {shown}.*as an int")


def test_other_forms_refused():
    wrong({**RIGHT, "a": "rows 0 to 4"}, "pair")
    wrong({**RIGHT, "a": [(0, 4, 8), (4, 8), (8, 12), (12, 16)]}, "pair")
    wrong({**RIGHT, "c": [(0, 16)]}, "one pair per process")
    wrong({**RIGHT, "a": np.zeros((4, 3), dtype=int)}, "pair")
    wrong({"a": RIGHT["a"], "b": RIGHT["b"]}, "exactly the keys")
