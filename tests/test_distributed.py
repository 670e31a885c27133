"""The multi-process lesson's library (course_lib.distributed), in this one process: splitting devices over
processes, the rows each process loads, the prepared inputs (the lab's seed rule), and papermill-style
string parameters accepted on the multi-process path as on the lab's."""

import jax
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import distributed
from course_lib.config import PROFILES, init_run
from course_lib.meshes import DATA, data_mesh


def test_plan():
    assert distributed.plan(8)[:2] == (2, 4)
    assert distributed.plan(2)[:2] == (2, 1)
    assert distributed.plan(1)[:2] == (1, 1)
    assert distributed.plan(3)[:2] == (1, 3) and "cannot be split evenly" in distributed.plan(3)[2]
    assert distributed.plan(8, 4)[:2] == (4, 2)
    assert distributed.plan(1, 2, fallback=True)[:2] == (1, 1)
    with pytest.raises(
        ValueError, match="8 devices do not split evenly over 3 processes.*\\[1, 2, 4, 8\\]"
    ):
        distributed.plan(8, 3)


def test_local_rows_in_one_process(report):
    sharding = NamedSharding(data_mesh(report.devices), P(DATA))
    assert distributed.local_rows(sharding, (32, 3)) == (0, 32)
    assert distributed.process_rows(32, 2, 1) == (16, 32)
    # the rows a process of a group would hold: its devices' block of the mesh
    assert distributed.local_rows(sharding, (32, 3), devices=report.devices[4:]) == (16, 32)


def test_prepared_inputs_follow_the_labs_seed_rule(tmp_path):
    folder = distributed.prepare_inputs(tmp_path / "inputs", "tiny", 2, seed=0)
    start = init_run(PROFILES["tiny"], 0)
    with np.load(folder / "params.npz") as f:
        saved = {name: f[name] for name in f.files}
    want = traverse_util.flatten_dict(jax.device_get(start.params), sep="/")
    assert set(saved) == set(want) and all(np.array_equal(saved[k], want[k]) for k in want)
    images = np.load(folder / "images.npy")
    first = start.dataset.batch(
        jax.random.fold_in(start.data_key, 0), PROFILES["tiny"].global_batch
    )
    np.testing.assert_array_equal(images[0], np.asarray(first[0]))


def test_string_parameters_work_on_the_multi_process_path(report, tmp_path):
    # papermill -r passes strings: "3" is accepted here as it is by the lab (config.resolve_profile).
    folder = distributed.prepare_inputs(tmp_path / "inputs", "tiny", "3", seed="0")
    assert distributed.plan("8", "2")[:2] == (2, 4)
    assert distributed.process_rows("32", "2", 1) == (16, 32)
    runs = distributed.train_strategies(report.devices, folder, ["sharded_jit"], steps="3")
    assert len(runs["sharded_jit"]["losses"]) == 3
    with pytest.raises(ValueError, match="steps='three' is not an integer"):
        distributed.prepare_inputs(tmp_path / "other", "tiny", "three")


def test_loopback_tcp_says_why_a_host_allows_no_process_group(monkeypatch):
    import socket

    assert distributed.loopback_tcp() is None  # this machine: a process may listen on the loopback

    class NoTCP:
        def __init__(self, *args, **kwargs):
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(socket, "socket", NoTCP)
    assert distributed.loopback_tcp() == "PermissionError: [Errno 1] Operation not permitted"
