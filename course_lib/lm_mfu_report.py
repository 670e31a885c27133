"""The committed one-chip measurement of ``tools/lm_mfu.py`` (``data/tpu_reference/lm_mfu/mfu.csv``): read,
described line by line, the program's bytes per row; shown in ``notebooks/12_transformer_lab.ipynb``.
:mod:`course_lib.lm_mfu` names these functions too."""

from __future__ import annotations

from pathlib import Path

from . import measure as _measure


def reference(path: str | Path | None = None):
    """The committed measurement (``mfu.csv`` of ``tools/lm_mfu.py``) as a pandas DataFrame, or None when the
    file is absent (not yet measured). Default path: :data:`course_lib.lm_mfu.REFERENCE_CSV`."""
    import pandas as pd

    from .lm_mfu import REFERENCE_CSV

    path = Path(path) if path is not None else REFERENCE_CSV
    return pd.read_csv(path) if path.exists() else None


def describe_reference(committed) -> list[str]:
    """Lines that show a committed measurement (:func:`reference`'s DataFrame): its chip, date and versions;
    per row the batch, ``remat``, step time (ms), MFU, HFU and temporaries (``memory_analysis()``), or "does
    not fit"; the allocator's peak beside the program's bytes (arguments + outputs + temporaries - donated,
    :func:`program_bytes`) for the rows that fit; and the matmul ceiling (TFLOP/s) where one was measured.
    Shown in ``notebooks/12_transformer_lab.ipynb``, whose cell asserts on the same figures.

    Raises:
      KeyError: a column of ``tools/lm_mfu.py``'s ``mfu.csv`` is missing.
      IndexError: ``committed`` has no row.
    """
    first = committed.iloc[0]
    lines = [
        f"{first['device_kind']}, {first['date']}, JAX {first['jax']}, jaxlib {first['jaxlib']}, "
        f"libtpu {first['libtpu']}, Python {first['python']}"
    ]
    for r in committed.itertuples():
        if not r.fits:
            lines.append(f"  batch {r.batch}, remat={r.remat}: does not fit")
            continue
        lines.append(
            f"  batch {r.batch}, remat={r.remat}: step {r.step_s * 1e3:.0f} ms, MFU {r.mfu:.1%} "
            f"(HFU {r.hfu:.1%}), temporaries {_measure.human_bytes(r.temp_bytes)} (memory_analysis)"
        )
    fit = committed[committed["fits"].astype(bool)]
    if len(fit):
        peaks = ", ".join(_measure.human_bytes(b) for b in fit["peak_bytes"])
        need = ", ".join(_measure.human_bytes(b) for b in program_bytes(fit))
        lines.append(
            f"  allocator peak {peaks}; the program's bytes {need} "
            "(memory_analysis: arguments + outputs + temporaries - donated)"
        )
    ceilings = committed["ceiling_flops"].dropna()
    if len(ceilings):
        lines.append(
            f"  a 4096 x 4096 bfloat16 matmul on the same chip: {ceilings.iloc[0] / 1e12:.0f} TFLOP/s"
        )
    return lines


def program_bytes(rows):
    """What a measured program holds on the chip, per row of :func:`reference`'s DataFrame (bytes): its
    arguments + outputs + temporaries, less the donated (aliased) parameters it writes into.

    Raises:
      KeyError: a ``*_bytes`` column is missing.
    """
    return rows["argument_bytes"] + rows["output_bytes"] + rows["temp_bytes"] - rows["alias_bytes"]
