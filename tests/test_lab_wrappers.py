"""Lab 08's section 2 shows each strategy's wrapper condensed from ``course_lib/builders.py``: the names it
shows exist, and the keywords it quotes are the builders' own (a guard against the copy drifting)."""

import json
import re
from pathlib import Path

from course_lib import builders, parallel

ROOT = Path(__file__).resolve().parents[1]


def _snippet() -> str:
    nb = json.loads((ROOT / "notebooks" / "08_lab.ipynb").read_text())
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and text.startswith(
            "**How each strategy wraps the step.**"
        ):
            return text
    raise AssertionError("lab 08 lost its 'How each strategy wraps the step' cell")


def test_the_wrapper_snippet_names_what_the_library_has():
    text = _snippet()
    for name in re.findall(r"parallel\.(\w+)", text):
        assert hasattr(parallel, name), (
            f"the snippet names parallel.{name}, which the library lacks"
        )
    for name in (
        "build_jit",
        "build_pmap",
        "build_sharded_jit",
        "_shard_map_strategy",
        "build_fsdp",
    ):
        assert f"`{name}`" in text and hasattr(builders, name), name


def test_the_wrapper_snippet_quotes_the_builders_keywords():
    text, source = _snippet(), (ROOT / "course_lib" / "builders.py").read_text()
    for quoted in ('sync="grads"', 'sync="loss"', "check_vma=True"):
        assert quoted in text and quoted in source, quoted
