"""The lab's configuration: profiles, the one rule that types notebook parameters, the seed rule."""

import jax
import numpy as np
import pytest

from course_lib import config, data, lab, model


def test_profiles():
    assert config.resolve_profile("auto", "cpu").name == "cpu"
    gpu = config.resolve_profile("auto", "gpu")
    assert config.resolve_profile("auto", "tpu") == gpu  # the article's setting on any accelerator
    assert (gpu.image_size, gpu.global_batch) == (128, 512)  # the source article's setting
    assert config.resolve_profile("cpu", "cpu", steps="7").steps == 7
    assert config.resolve_profile("cpu", "cpu", steps=0).steps == config.PROFILES["cpu"].steps
    assert config.resolve_profile("tiny", "cpu", global_batch=16).global_batch == 16
    with pytest.raises(ValueError, match="profile='huge'"):
        config.resolve_profile("huge", "cpu")
    with pytest.raises(ValueError, match="steps='eight'"):
        config.resolve_profile("cpu", "cpu", steps="eight")
    with pytest.raises(ValueError, match="must exceed the 2 warm-up steps"):
        config.resolve_profile("cpu", "cpu", steps=2)
    with pytest.raises(ValueError, match="global_batch=-4"):
        config.resolve_profile("cpu", "cpu", global_batch=-4)


@pytest.mark.parametrize(
    "value, expected", [(True, True), ("False", False), ("true", True), (0, 0), ("1", True)]
)
def test_parse_bool(value, expected):
    assert config.coerce(config.LAB_PARAMS["overwrite"], value) is bool(expected)


def test_parse_bool_rejects_other_values():
    with pytest.raises(ValueError, match="overwrite='maybe' is not a yes/no value"):
        config.coerce(config.LAB_PARAMS["overwrite"], "maybe")


@pytest.mark.parametrize(
    "n, batch", [(1, 64), (2, 64), (3, 66), (4, 64), (5, 80), (6, 72), (7, 84), (8, 64)]
)
def test_default_batch_fits_any_device_count(n, batch, capsys):
    cfg = config.resolve_profile("cpu", "cpu", n_devices=n)
    assert cfg.global_batch == batch
    assert ("note: global batch 64 ->" in capsys.readouterr().out) == (batch != 64)
    with pytest.raises(ValueError, match="global batch 64 is not divisible by 3"):
        lab.check_divisibility(
            config.resolve_profile("cpu", "cpu", global_batch=64, n_devices=3), 3
        )


@pytest.mark.parametrize("bad", ["three", -1, 1.5, True])
def test_seed_is_checked(bad):
    with pytest.raises(ValueError, match="seed="):
        config.coerce(config.LAB_PARAMS["seed"], bad)
    assert (
        config.coerce(config.LAB_PARAMS["seed"], "3") == 3
        and config.coerce(config.LAB_PARAMS["seed"], 0) == 0
    )


# ---- the one rule for notebook parameters -------------------------------------------------------------------

STEPS = config.LAB_PARAMS["steps"]
SCALING = config.LAB_PARAMS["scaling"]
PROFILE = config.LAB_PARAMS["profile"]


@pytest.mark.parametrize(
    "param, value, expected",
    [
        (STEPS, "3", 3),  # papermill -r
        (STEPS, " 3 ", 3),
        (STEPS, 3, 3),  # papermill -p / -y
        (STEPS, 3.0, 3),
        (STEPS, np.int64(3), 3),
        (SCALING, "False", False),
        (SCALING, "no", False),
        (SCALING, "YES", True),
        (SCALING, 1, True),
        (SCALING, np.int64(0), False),
        (PROFILE, " Tiny ", "tiny"),
        (config.MULTIHOST_PARAMS["timeout_s"], "0.5", 0.5),
        (config.MULTIHOST_PARAMS["timeout_s"], 240, 240.0),
    ],
)
def test_coerce_accepts_what_papermill_passes(param, value, expected):
    got = config.coerce(param, value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "param, value, fragment",
    [
        (
            STEPS,
            "three",
            r"steps=.three. is not an integer; give a whole number such as 20 \(papermill: -p steps 20\)",
        ),
        (STEPS, True, "steps=True is a bool"),
        (STEPS, 2.5, "steps=2.5 is not a whole number"),
        (STEPS, "2.5", "steps='2.5' is not an integer"),
        (STEPS, -1, "steps=-1 must be a non-negative integer"),
        (config.N_DEVICES, "0", "n_devices='0' must be a positive integer"),
        (SCALING, "maybe", "scaling='maybe' is not a yes/no value; use True or False"),
        (SCALING, 2, "scaling=2 is not a yes/no value"),
        (PROFILE, "huge", "profile='huge' is not one of \\['auto', 'cpu', 'gpu', 'tiny'\\]"),
        (config.MULTIHOST_PARAMS["timeout_s"], "soon", "timeout_s='soon' is not a number"),
    ],
)
def test_coerce_names_the_parameter_the_value_and_the_fix(param, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        config.coerce(param, value)


def test_argparse_type_keeps_the_message():
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--steps", type=config.arg_type(STEPS), default=0)
    assert parser.parse_args(["--steps", "7"]).steps == 7
    with pytest.raises(argparse.ArgumentError, match="steps='x' is not an integer") as e:
        parser.parse_args(["--steps", "x"])
    assert "papermill" not in str(e.value)  # a command line's fix is the option, not papermill's -p


def _parameters_cell(name):
    import ast
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / name, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    return {s.targets[0].id: ast.literal_eval(s.value) for s in ast.parse(cell.source).body}


@pytest.mark.parametrize(
    "notebook, params",
    [("08_lab.ipynb", config.LAB_PARAMS), ("09_multihost.ipynb", config.MULTIHOST_PARAMS)],
)
def test_the_parameters_cell_declares_exactly_the_declared_parameters(notebook, params):
    cell = _parameters_cell(notebook)
    assert list(cell) == list(params)
    for name, value in cell.items():
        assert value == params[name].default and config.coerce(params[name], value) == value, name


def test_coerce_params_types_a_whole_parameters_cell():
    values = {"steps": "3", "scaling": "False", "seed": "2", "unrelated": object()}
    typed = config.coerce_params(config.LAB_PARAMS, values)
    assert list(typed) == list(config.LAB_PARAMS)
    assert typed["steps"] == 3 and typed["scaling"] is False and typed["seed"] == 2
    assert typed["profile"] == "auto" and typed["n_devices"] == 8  # absent: the default


# ---- the nested config, one tiny model, the seed rule -----------------------------------------------------


def test_lab_config_nests_the_model_and_the_data():
    tiny = config.PROFILES["tiny"]
    assert tiny.model == model.TINY  # one tiny config, the model's
    assert tiny.image_size == tiny.data.image_size == model.TINY.image_size
    with pytest.raises(
        ValueError, match="the model's image_size=16 differs from the data's image_size=32"
    ):
        config.LabConfig(
            "x", model.TINY, data.SyntheticImages(image_size=32), global_batch=8, steps=4
        )


def test_init_run_is_the_seed_rule():
    tiny = config.PROFILES["tiny"]
    start = config.init_run(tiny, "1")
    _, params = model.init_model(jax.random.key(1), tiny.model)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(params), strict=True)
    )
    assert np.array_equal(
        jax.random.key_data(start.data_key), jax.random.key_data(jax.random.key(2))
    )
    abstract = config.init_run(tiny, 1, abstract_params=True)
    assert [x.shape for x in jax.tree.leaves(abstract.params)] == [
        x.shape for x in jax.tree.leaves(params)
    ]
    with pytest.raises(ValueError, match="seed=-1 must be a non-negative integer"):
        config.init_run(tiny, -1)


def test_platform_parameter_names_the_accelerators():
    assert config.PLATFORM.choices == ("auto", "cpu", "gpu", "tpu")
    assert config.coerce(config.PLATFORM, " TPU ") == "tpu"
    with pytest.raises(
        ValueError, match=r"platform='npu' is not one of \['auto', 'cpu', 'gpu', 'tpu'\]"
    ):
        config.coerce(config.PLATFORM, "npu")
    assert "tpu" in config.PLATFORM.help and config.LAB_PARAMS["platform"] is config.PLATFORM
