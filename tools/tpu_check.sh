#!/usr/bin/env bash
# The course's TPU check: one command on a TPU host (a Colab/Kaggle TPU VM, a Cloud TPU VM, a sandboxed host
# with no network). `tools/tpu_check.sh --help` says what it does; tests/test_tpu_check.py exercises it on CPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="tools/tpu_check.sh"

usage() {
  cat <<EOF
Usage: $PROG [--out DIR] [--python PATH] [--index URL] [--wheelhouse DIR] [--site DIR] [--skip-install]
                         [--notebooks "01 08 …"] [--steps "tests notebooks lab programs mfu"] [--timeout SECONDS]
                         [--lab-param NAME=VALUE]... [--rehearse]
                         [-h|--help]

The course's TPU check, run on a TPU host with JAX already installed (a TPU image ships its own JAX; the
course runs on JAX 0.10.2 / Python 3.11 and on the pinned 0.12). No Jupyter kernel is started: every
notebook runs in a Python process of its own (python -m course_tools.inprocess), since some TPU hosts allow
no TCP sockets. One program holds the chips at a time, so everything runs one after the other. In order:
  1. checks that JAX's backend is a TPU; without one it stops ("no TPU found", exit 3);
  2. installs the course's other dependencies (flax, optax, pandas, matplotlib, …) into --site from the
     host's package index (--index) and --wheelhouse (e.g. chex, treescope), keeping the host's JAX, jaxlib,
     libtpu and numpy first on the path (skip with --skip-install);
  3. prints the device report (course_lib.devices.setup_devices(n, "tpu")) and the versions;
  4. runs the tests marked tpu (tests/test_tpu.py, tests/test_aot.py) in one process;
  5. runs every notebook (or --notebooks) at the host's chip count, each in its own process;
  6. runs the lab (08_lab) at profile auto in bfloat16: the largest article-like batch that fits the chip;
  7. compiles the course's programs for an 8-chip v5e (tools/tpu_programs.py, when present);
  8. measures the transformer's bfloat16 training step at its gpu size on one chip, batches 1 2 4 8 with and
     without remat: step time, MFU, memory (tools/lm_mfu.py: lm_mfu/mfu.csv, the file committed as
     data/tpu_reference/lm_mfu/mfu.csv);
  9. writes everything into a new folder data/tpu_reference/<date>-<chip>-x<count>/: summary.txt (which
     notebooks passed, each one's seconds and failing cell), notebooks.csv, versions.txt, device.txt,
     the lab's results CSVs, memory.csv (each notebook's allocator peak, memory_stats()), logs/ (one per step).
Steps 4 to 8 run even when an earlier one fails; summary.txt says which passed.

Options:
  --out DIR             results folder (default data/tpu_reference/<date>-<chip>-x<count>, -2, -3 … when it
                        exists); it must not exist: an earlier reference is never overwritten (exit 4)
  --python PATH         the Python that has JAX with the TPU backend (default: python3 as resolved from /,
                        where no .python-version redirects a pyenv shim; .venv/bin/python with --rehearse)
  --index URL           package index for step 2 (default file:///opt/pypi/simple if it exists, else PyPI)
  --wheelhouse DIR      extra wheels to install without their dependencies (chex, treescope …)
  --site DIR            where step 2 installs (default /tmp/course-site); added to the end of PYTHONPATH
  --skip-install        use the environment as it is
  --notebooks LIST      which notebooks (by number), default every one
  --steps LIST          which of steps 4-8 to run: tests notebooks lab programs mfu (default all five); a
                        host's session too short for all of them runs them in two calls, e.g. --steps
                        "tests programs" --notebooks "01 02", then --steps "notebooks lab" --notebooks "08 10"
  --timeout SECONDS     limit for each notebook (default 300)
  --lab-param N=V       one more parameter for the lab run of step 6, e.g. --lab-param steps=10
  --rehearse            check this script on a machine without a TPU: 2 simulated CPU devices, the notebooks
                        named by --notebooks (default 03), the mfu step at the tiny size, no install; needs
                        --out; NOT a TPU reference
  -h, --help            this text

Exit status: 0 every step passed; 1 a test, notebook or lab run failed (results still written); 2 bad
arguments; 3 no TPU found; 4 the results folder exists or cannot be written.
EOF
}

die() {
  local code=$1
  shift
  echo "$PROG: $*" >&2
  exit "$code"
}
need_value() { [[ $# -ge 2 && -n $2 && $2 != --* ]] || die 2 "$1 needs a value (see $PROG --help)"; }

STEPS="tests notebooks lab programs mfu" OUT="" PY="" INDEX="" WHEELHOUSE="" SITE="/tmp/course-site" SKIP_INSTALL=0 NOTEBOOKS="" TIMEOUT=300 REHEARSE=0
LAB_PARAMS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    -h | --help) usage && exit 0 ;;
    --out) need_value "$@" && OUT=$2 && shift 2 ;;
    --python) need_value "$@" && PY=$2 && shift 2 ;;
    --index) need_value "$@" && INDEX=$2 && shift 2 ;;
    --wheelhouse) need_value "$@" && WHEELHOUSE=$2 && shift 2 ;;
    --site) need_value "$@" && SITE=$2 && shift 2 ;;
    --skip-install) SKIP_INSTALL=1 && shift ;;
    --notebooks) need_value "$@" && NOTEBOOKS=$2 && shift 2 ;;
    --steps) need_value "$@" && STEPS=$2 && shift 2 ;;
    --timeout) need_value "$@" && TIMEOUT=$2 && shift 2 ;;
    --lab-param) need_value "$@" && LAB_PARAMS+=("$2") && shift 2 ;;
    --rehearse) REHEARSE=1 && shift ;;
    *) die 2 "unknown argument '$1'; see $PROG --help" ;;
  esac
done
[[ $TIMEOUT =~ ^[0-9]+$ && $TIMEOUT -gt 0 ]] || die 2 "--timeout $TIMEOUT is not a positive number of seconds"
for s in $STEPS; do [[ $s =~ ^(tests|notebooks|lab|programs|mfu)$ ]] || die 2 "--steps: no step '$s' (tests notebooks lab programs mfu)"; done
wants() { [[ " $STEPS " == *" $1 "* ]]; }
for p in "${LAB_PARAMS[@]}"; do [[ $p == *=* ]] || die 2 "--lab-param $p is not NAME=VALUE"; done
[[ -z $WHEELHOUSE || -d $WHEELHOUSE ]] || die 2 "--wheelhouse $WHEELHOUSE is not a folder"
if [[ $REHEARSE == 1 ]]; then
  [[ -n $OUT ]] || die 2 "--rehearse needs --out (a rehearsal is not a TPU reference)"
  SKIP_INSTALL=1 NOTEBOOKS=${NOTEBOOKS:-03}
  [[ -n $PY || ! -x $ROOT/.venv/bin/python ]] || PY=$ROOT/.venv/bin/python
fi
# A .python-version in the checkout makes a pyenv shim pick another Python: resolve python3 from /.
[[ -n $PY ]] || PY=$(cd / && command -v python3)
[[ -n $PY ]] || die 2 "no python3 found; name the Python that has JAX with --python"
PY=$(cd / && "$PY" -c 'import sys; print(sys.executable)') || die 2 "--python $PY does not run"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

# 1. a TPU
if [[ $REHEARSE == 1 ]]; then
  export JAX_PLATFORMS=cpu
  N=2 CHIP=rehearsal
else
  backend=$(cd / && "$PY" -c 'import jax; print(jax.default_backend(), len(jax.devices()), jax.devices()[0].device_kind)' 2>/dev/null | tail -n 1)
  [[ $backend == tpu* ]] || die 3 "no TPU found (JAX's backend: ${backend:-none}); run this on a TPU host"
  read -r _ N CHIP_KIND <<<"$backend"
  CHIP=$(echo "$CHIP_KIND" | tr 'A-Z ' 'a-z-')
fi

# 2. the course's other dependencies, after the host's JAX on the path
if [[ $SKIP_INSTALL == 0 ]]; then
  if [[ -z $INDEX ]]; then [[ -d /opt/pypi/simple ]] && INDEX=file:///opt/pypi/simple || INDEX=https://pypi.org/simple; fi
  mkdir -p "$SITE" || die 4 "cannot create --site $SITE"
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: --index-url "$INDEX" \
    --target "$SITE" flax optax pandas matplotlib tqdm orbax-checkpoint rich ipython toolz absl-py \
    || die 1 "installing the course's dependencies from $INDEX failed"
  # what the notebooks' side paths use (00 inspects its parameters with papermill): best effort
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --only-binary=:all: --index-url "$INDEX" \
    --target "$SITE" papermill nbformat || echo "$PROG: papermill not in $INDEX: lesson 00's inspection cell will say so"
  if [[ -n $WHEELHOUSE ]]; then
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-index --no-deps --target "$SITE" \
      "$WHEELHOUSE"/*.whl || die 1 "installing the wheels of $WHEELHOUSE failed"
  fi
  # pip brings its own numpy/jax along: the host's (built for its libtpu) must stay the ones imported
  (cd "$SITE" && rm -rf numpy numpy-* numpy.libs jax jax-* jaxlib jaxlib-* jax_plugins libtpu* ml_dtypes \
    ml_dtypes-* scipy scipy-* scipy.libs opt_einsum opt_einsum-*)
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE:$ROOT"

# 9. the results folder: new, writable
if [[ -z $OUT ]]; then
  base="$ROOT/data/tpu_reference/$(date -u +%Y-%m-%d)-$CHIP-x$N"
  OUT=$base k=2
  while [[ -e $OUT ]]; do OUT="$base-$k" && k=$((k + 1)); done
fi
[[ -e $OUT ]] && die 4 "$OUT exists: an earlier TPU reference is never overwritten; name another --out"
mkdir -p "$OUT/logs" "$OUT/notebooks" "$OUT/lab" && touch "$OUT/.w" && rm "$OUT/.w" || die 4 "cannot write $OUT"
echo "$PROG: results go to $OUT"

status=0
step() { # step NAME COMMAND...: run, log, record
  local name=$1
  shift
  local t0=$SECONDS
  (cd "$ROOT" && timeout "${STEP_TIMEOUT:-$TIMEOUT}" "$@") >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
  [[ $rc == 0 ]] || status=1
  sleep 3 # the chip is released a moment after a program ends
}

# 3. device report and versions
step device "$PY" -c "
import sys, jax, jaxlib
from course_lib import devices
r = devices.setup_devices($N, 'cpu' if '$REHEARSE' == '1' else 'tpu')
print(r)
print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)
"
cp "$OUT/logs/device.log" "$OUT/device.txt"
(cd "$ROOT" && git rev-parse HEAD 2>/dev/null; date -u +%FT%TZ; "$PY" -c 'import sys; print(sys.version)';
 "$PY" -m pip list 2>/dev/null | grep -Ei '^(jax|jaxlib|libtpu|flax|optax|numpy|chex|orbax|pandas|matplotlib) ') \
  >"$OUT/versions.txt" 2>&1

# 4. the tests marked tpu
if [[ $REHEARSE == 0 ]] && wants tests; then
  # --noconftest: the suite's conftest fixes 8 simulated CPU devices; these tests need the chip
  step tests "$PY" -m pytest tests/test_tpu.py tests/test_aot.py -m tpu --noconftest -p no:xdist \
    -p no:cacheprovider -o addopts="" -q
fi

# 5. every notebook at the host's chip count
[[ -n $NOTEBOOKS ]] || NOTEBOOKS=$(cd "$ROOT/notebooks" && ls [0-9][0-9]_*.ipynb | cut -c1-2 | tr '\n' ' ')
wants notebooks || NOTEBOOKS=""
for num in $NOTEBOOKS; do
  nb=$(cd "$ROOT/notebooks" && ls "$num"_*.ipynb 2>/dev/null | head -n 1)
  [[ -n $nb ]] || die 2 "no notebook numbered $num in notebooks/"
  name=${nb%.ipynb}
  extra=()
  [[ $name == 08_lab ]] && extra=(-p results_dir "$OUT/lab/notebook" -p overwrite True)
  [[ $REHEARSE == 1 && $name == 08_lab ]] && extra+=(-p profile tiny)
  step "$name" "$PY" -m course_tools.inprocess "notebooks/$nb" "$OUT/notebooks/$nb" -p n_devices "$N" \
    -p platform "$([[ $REHEARSE == 1 ]] && echo cpu || echo tpu)" "${extra[@]}" --report "$OUT/notebooks/$name.json"
done

# 6. the lab at the largest article-like profile that fits, in bfloat16
if [[ $REHEARSE == 0 ]] && wants lab; then
  lab=(-p profile auto -p precision bfloat16 -p results_dir "$OUT/lab/bf16" -p overwrite True)
  for p in "${LAB_PARAMS[@]}"; do lab+=(-p "${p%%=*}" "${p#*=}"); done
  step lab_bf16 "$PY" -m course_tools.inprocess notebooks/08_lab.ipynb "$OUT/lab/08_lab_bf16.ipynb" \
    -p n_devices "$N" -p platform tpu "${lab[@]}" --report "$OUT/lab/08_lab_bf16.json"
fi

# 7. programs for an 8-chip v5e, compiled here
if [[ $REHEARSE == 0 ]] && wants programs; then
  step programs "$PY" tools/tpu_programs.py --out "$OUT/programs"
fi

# 8. the transformer's MFU on one chip (the gpu size; --rehearse: the tiny size on a CPU, no MFU), at least 15 min
if wants mfu; then
  mfu=()
  [[ $REHEARSE == 1 ]] && mfu=(--config tiny --batches 2 --steps 2 --warmup 1)
  STEP_TIMEOUT=$((TIMEOUT > 900 ? TIMEOUT : 900)) step mfu "$PY" tools/lm_mfu.py --out "$OUT/lm_mfu" "${mfu[@]}"
fi

# summary
(cd "$ROOT" && "$PY" - "$OUT" <<'PY'
import csv, glob, json, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{out}/notebooks/*.json") + glob.glob(f"{out}/lab/*.json")):
    r = json.load(open(f))
    mem = r.get("memory_stats") or {}
    rows.append({"notebook": os.path.basename(f)[:-5], "ok": r["ok"], "seconds": r.get("seconds"),
                 "failed_cell": r.get("failed_cell"), "error": (r.get("error") or "")[:300],
                 "peak_bytes_in_use": mem.get("peak_bytes_in_use"), "bytes_limit": mem.get("bytes_limit")})
if rows:
    with open(f"{out}/notebooks.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader(); w.writerows(rows)
with open(f"{out}/summary.txt", "w") as fh:
    ok = sum(r["ok"] for r in rows)
    print(f"{ok} of {len(rows)} notebook runs passed", file=fh)
    for r in rows:
        print(f"{r['notebook']}: {'ok' if r['ok'] else 'FAILED at cell %s: %s' % (r['failed_cell'], r['error'])}"
              f" ({r['seconds']} s)", file=fh)
    if os.path.exists(f"{out}/steps.txt"):
        print(open(f"{out}/steps.txt").read(), file=fh, end="")
print(open(f"{out}/summary.txt").read())
PY
)
exit $status
