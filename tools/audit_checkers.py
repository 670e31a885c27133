"""Which wrong answers the exercise checkers accept on few devices: runs tests/test_checks_lessonNN.py with
1 and 2 simulated CPU devices (``COURSE_TEST_DEVICES``, read by tests/conftest.py; the suite itself runs at
8) and lists each ``rejects(...)`` test that did not raise there: a wrong answer given a success mark.

Other failures are listed apart: a refusal with another message than the 8-device one (still a refusal),
or a test whose own answer assumes 8 devices. Slow (every checker test file once per count): run it by
hand, not in the suite::

    .venv/bin/python tools/audit_checkers.py            # lessons 01-12 at 1 and 2 devices
    .venv/bin/python tools/audit_checkers.py 10 11 --counts 1
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def audit(lesson: str, n: int) -> list[tuple[str, str]]:
    """``(test, verdict)`` for each failing test of ``tests/test_checks_lesson{lesson}*.py`` at ``n``
    devices; verdict ``"ACCEPTED"`` (a wrong answer passed), ``"refused, another message"`` or
    ``"other: …"``."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        # the lesson's file and its split-off ones (test_checks_lesson09_mesh.py, …)
        files = sorted(glob.glob(f"tests/test_checks_lesson{lesson}*.py", root_dir=ROOT))
        cmd = [sys.executable, "-m", "pytest", *files, "-q"]
        cmd += ["-p", "no:xdist", "-o", "addopts=", "-p", "no:warnings", f"--junitxml={xml}"]
        env = os.environ | {"COURSE_TEST_DEVICES": str(n)}
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        out = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            for bad in [*case.findall("failure"), *case.findall("error")]:
                text = (bad.get("message") or "") + (bad.text or "")
                if "DID NOT RAISE" in text:
                    verdict = "ACCEPTED"
                elif "Regex pattern did not match" in text:
                    verdict = "refused, another message"
                else:
                    verdict = "other: " + (bad.get("message") or "").replace("\n", " ")[:120]
                out.append((case.get("name"), verdict))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", default=[f"{i:02d}" for i in range(1, 13)])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    accepted = 0
    for n in args.counts:
        for lesson in args.lessons:
            rows = audit(lesson, n)
            accepted += sum(v == "ACCEPTED" for _, v in rows)
            print(f"lesson {lesson}, {n} device(s): {len(rows)} failing test(s)", flush=True)
            for name, verdict in rows:
                print(f"  {name}: {verdict}", flush=True)
    print(f"wrong answers accepted: {accepted}")
    return 1 if accepted else 0


if __name__ == "__main__":
    sys.exit(main())
