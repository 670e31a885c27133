#!/usr/bin/env bash
# The course's prepared GPU check: one command on a GPU host, under 5 minutes, a GPU reference run in data/.
# `tools/gpu_check.sh --help` says what it does; tests/test_gpu_check.py exercises it on CPU.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="tools/gpu_check.sh"

usage() {
  cat <<EOF
Usage: $PROG [--out DIR] [--skip-install] [--timeout SECONDS] [--python PATH] [--wheelhouse DIR]
                         [--lab-param NAME=VALUE]... [--dry-run] [--rehearse] [-h|--help]

The course's GPU check, run once on a GPU host (target: under 5 minutes). In order:
  1. looks for GPUs with nvidia-smi; without one it stops ("no GPU found", exit 3) before installing anything;
  2. installs the CUDA build of the pinned JAX into the course environment:
     pip install "jax[cuda12]==<the jax pin of requirements.txt>" (skip with --skip-install);
  3. checks that JAX sees the GPUs, prints the device report (course_lib.devices.setup_devices);
  4. runs the tests marked gpu (tests/test_gpu.py: device setup, parity of every strategy with
     single-device jit at the GPU tolerance, bfloat16 and float64 parity);
  5. runs the lab (notebooks/08_lab.ipynb, profile gpu) on all visible GPUs, then on one, and the
     transformer notebooks (10_transformers, 11_pipeline_experts, 12_transformer_lab) once on all of them;
  6. writes everything, with the hardware metadata (nvidia-smi, driver, CUDA, jax/jaxlib versions, date,
     git commit), to a new folder data/gpu_reference/<date>-<gpu>-x<count>/.
Steps 4 and 5 run even when an earlier one fails; the summary (summary.txt) says which passed.

Options:
  --out DIR             results folder (default data/gpu_reference/<date>-<gpu>-x<count>, or -2, -3, ...
                        when an earlier check of the same day has it); it must not exist: an earlier GPU
                        reference run is never overwritten (exit 4)
  --skip-install        use the environment as it is (the CUDA build of JAX already installed)
  --timeout SECONDS     limit for each step: install, tests, each lab run (default 300)
  --python PATH         the course environment's python (default .venv/bin/python, made by make setup)
  --wheelhouse DIR      install from wheels in DIR only (pip --no-index --find-links DIR), for a host
                        without internet: fill DIR elsewhere with
                        pip download "jax[cuda12]==<pin>" -d DIR  (same Python version and platform)
  --lab-param N=V       one more papermill parameter for both lab runs, e.g. --lab-param steps=30
  --dry-run             find the GPUs, check the results folder (writable, with room), print the plan;
                        change nothing
  --rehearse            check this script itself on a machine without GPUs: every step after the install,
                        on 2 simulated CPU devices, lab profile tiny, GPU tests skipped; needs --out, and
                        what it writes is NOT a GPU reference run
  -h, --help            this text

Before anything is installed it checks that the results folder can be written with 50 MB free, and that
the course environment has 4 GB free for the CUDA wheels (unless --skip-install).

Exit status: 0 every step passed; 1 a test or a lab run failed (results still written); 2 bad arguments;
3 no GPU found; 4 the results folder exists, cannot be written or lacks room (or the environment lacks room
for the install); 5 the environment cannot run JAX on the GPUs.
Environment: GPU_CHECK_NVIDIA_SMI names the nvidia-smi to use (default: nvidia-smi on PATH);
GPU_CHECK_RESULTS_ROOT the folder of the dated results folders (default data/gpu_reference).
EOF
}

die() {
  local code=$1
  shift
  echo "$PROG: $*" >&2
  exit "$code"
}

ORIG_ARGS="$*"
OUT="" SKIP_INSTALL=0 TIMEOUT=300 PY="$ROOT/.venv/bin/python" WHEELHOUSE="" DRY_RUN=0 REHEARSE=0
LAB_PARAMS=()
TRANSFORMER_NOTEBOOKS=(10_transformers 11_pipeline_experts 12_transformer_lab)
NVIDIA_SMI="${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}"

need_value() { # need_value OPTION "$@": exit 2 unless a value follows OPTION
  [[ $# -ge 2 && -n $2 && $2 != --* ]] || die 2 "$1 needs a value (see $PROG --help)"
}

while [[ $# -gt 0 ]]; do
  case $1 in
    -h | --help) usage && exit 0 ;;
    --out) need_value "$@" && OUT=$2 && shift 2 ;;
    --out=*) OUT=${1#*=} && shift ;;
    --skip-install) SKIP_INSTALL=1 && shift ;;
    --timeout) need_value "$@" && TIMEOUT=$2 && shift 2 ;;
    --timeout=*) TIMEOUT=${1#*=} && shift ;;
    --python) need_value "$@" && PY=$2 && shift 2 ;;
    --wheelhouse) need_value "$@" && WHEELHOUSE=$2 && shift 2 ;;
    --lab-param) need_value "$@" && LAB_PARAMS+=("$2") && shift 2 ;;
    --dry-run) DRY_RUN=1 && shift ;;
    --rehearse) REHEARSE=1 && shift ;;
    *) die 2 "unknown argument '$1'; see $PROG --help" ;;
  esac
done
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die 2 "--timeout '$TIMEOUT' is not a whole number of seconds (e.g. --timeout 300)"
for kv in ${LAB_PARAMS[@]+"${LAB_PARAMS[@]}"}; do
  [[ $kv =~ ^[a-z_]+=.+$ ]] || die 2 "--lab-param '$kv' is not NAME=VALUE (e.g. --lab-param steps=30)"
done
[[ -z $WHEELHOUSE || -d $WHEELHOUSE ]] || die 2 "--wheelhouse '$WHEELHOUSE' is not a folder"
[[ $REHEARSE -eq 0 || -n $OUT ]] || die 2 "--rehearse needs --out DIR (a rehearsal is not a GPU reference run)"
[[ -z $OUT || $OUT == /* ]] || OUT="$PWD/$OUT" # relative to where it was typed, not the project root
PLATFORM=gpu PROFILE=gpu REQUIRE_GPU=1 TESTS_OK=0
if [[ $REHEARSE -eq 1 ]]; then # the GPU steps' plumbing on simulated CPU devices
  NVIDIA_SMI=true PLATFORM=cpu PROFILE=tiny REQUIRE_GPU=0 SKIP_INSTALL=1 TESTS_OK=5 # 5: all skipped
fi

# ---- 1. GPUs, before anything is installed ----------------------------------------------------------
if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
  die 3 "no GPU found: looked for '$NVIDIA_SMI' (the NVIDIA driver's tool that lists GPUs) on PATH and it is" \
    "not there. Run this on a host with NVIDIA GPUs and their driver, where 'nvidia-smi -L' lists them." \
    "Nothing was installed."
fi
QUERY=index,name,memory.total,driver_version,pci.bus_id
if [[ $REHEARSE -eq 1 ]]; then
  GPU_CSV="0, simulated CPU device, -, -, -"$'\n'"1, simulated CPU device, -, -, -"
elif ! GPU_CSV=$("$NVIDIA_SMI" --query-gpu=$QUERY --format=csv,noheader 2>&1); then
  die 3 "no GPU found: '$NVIDIA_SMI --query-gpu=$QUERY' failed: $(head -n 1 <<<"$GPU_CSV")." \
    "Check the driver ('nvidia-smi' alone). Nothing was installed."
fi
N_GPUS=$(grep -c . <<<"$GPU_CSV" || true)
[[ $N_GPUS -gt 0 ]] || die 3 "no GPU found: '$NVIDIA_SMI --query-gpu=$QUERY' lists none. Nothing was installed."
if [[ -n ${CUDA_VISIBLE_DEVICES+x} && ( -z $CUDA_VISIBLE_DEVICES || $CUDA_VISIBLE_DEVICES == -1 ) ]]; then
  die 3 "no GPU found for JAX: nvidia-smi lists $N_GPUS, but CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'" \
    "hides them all (unset it). Nothing was installed."
fi
GPU_NAME=$(head -n 1 <<<"$GPU_CSV" | cut -d, -f2 | sed 's/^ *//; s/ *$//')
SLUG=$(tr '[:upper:]' '[:lower:]' <<<"$GPU_NAME" | sed 's/^nvidia //; s/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
DATE=$(date -u +%Y-%m-%d)
if [[ -z $OUT ]]; then # a second check on the same day gets a new folder beside the first
  BASE="${GPU_CHECK_RESULTS_ROOT:-$ROOT/data/gpu_reference}/$DATE-${SLUG:-gpu}-x$N_GPUS"
  OUT=$BASE
  for ((k = 2; k < 1000; k++)); do [[ -e $OUT ]] || break; OUT=$BASE-$k; done
elif [[ -e $OUT ]]; then
  die 4 "refusing to overwrite '$OUT': it exists, and a GPU reference run is never overwritten. Move it" \
    "away, or give a new folder with --out. Nothing was installed."
fi

check_room() { # check_room FOLDER NEED_MB WHAT FIX: writable (a file written and removed), NEED_MB free
  local folder=$1 need=$2 what=$3 fix=$4 near=$1 probe free
  while [[ ! -e $near ]]; do near=$(dirname "$near"); done
  [[ -d $near ]] || die 4 "cannot make the $what '$folder': '$near' is a file. $fix. Nothing was installed."
  probe=$(mktemp "$near/.gpu-check-write-test.XXXXXX" 2>/dev/null) ||
    die 4 "cannot write the $what '$folder': '$near' is not writable (read-only, or permissions)." \
      "$fix. Nothing was installed."
  rm -f "$probe"
  free=$(df -Pk "$near" | awk 'NR == 2 { print int($4 / 1024) }')
  [[ ${free:-0} -ge $need ]] ||
    die 4 "only ${free:-0} MB free for the $what '$folder' ('$near'); the check needs $need MB there." \
      "Make room there, or: $fix. Nothing was installed."
}
check_room "$OUT" 50 "results folder" "Give another folder with --out"
if [[ $SKIP_INSTALL -eq 0 ]]; then # the CUDA wheels of jax, cudnn, cublas, nccl: about 3 GB
  check_room "$(dirname "$(dirname "$PY")")" 4096 "course environment (for the CUDA build of JAX)" \
    "Give another environment with --python, or install the CUDA build yourself and pass --skip-install"
fi

# ---- the pinned JAX ---------------------------------------------------------------------------------
pin() { sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$ROOT/requirements.txt" | head -n 1; }
JAX_PIN=$(pin jax)
[[ -n $JAX_PIN ]] || die 5 "requirements.txt pins no jax version (a line 'jax==X')"
[[ $(pin jaxlib) == "$JAX_PIN" ]] || die 5 "requirements.txt pins jax==$JAX_PIN but jaxlib==$(pin jaxlib)"
PIP_ARGS=(install --quiet "jax[cuda12]==$JAX_PIN" "jaxlib==$JAX_PIN")
[[ -z $WHEELHOUSE ]] || PIP_ARGS+=(--no-index --find-links "$WHEELHOUSE")

N_ONE=1
LAB_COUNTS=("$N_GPUS")
[[ $N_GPUS -eq 1 ]] || LAB_COUNTS+=("$N_ONE")
if [[ $DRY_RUN -eq 1 ]]; then
  echo "GPUs (nvidia-smi): $N_GPUS x $GPU_NAME"
  echo "results folder   : $OUT (new)"
  echo "python           : $PY"
  if [[ $SKIP_INSTALL -eq 1 ]]; then echo "install          : skipped (--skip-install)"; else
    echo "install          : $PY -m pip ${PIP_ARGS[*]}"; fi
  echo "tests            : $PY -m pytest -m gpu tests/test_gpu.py -n 0"
  echo "lab runs         : notebooks/08_lab.ipynb, profile $PROFILE, on ${LAB_COUNTS[*]} GPU(s)"
  planned=("${TRANSFORMER_NOTEBOOKS[@]/#/notebooks/}")
  echo "transformer runs : ${planned[*]/%/.ipynb}, on ${LAB_COUNTS[0]} GPU(s)"
  echo "limit per step   : $TIMEOUT s"
  exit 0
fi
[[ -x $PY ]] || die 5 "no course environment: '$PY' is not an executable python. Run 'make setup' first, or" \
  "give the environment's python with --python."

# ---- 2. install, 3. JAX on the GPUs -------------------------------------------------------------------
unset JAX_PLATFORMS JAX_PLATFORM_NAME # a JAX_PLATFORMS=cpu left in the shell would hide the GPUs
[[ $REHEARSE -eq 0 ]] || export JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=$N_GPUS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # this checkout's course_lib, in tests and the lab
cd "$ROOT"
T_START=$SECONDS
if [[ $SKIP_INSTALL -eq 0 ]]; then
  echo "== install: $PY -m pip ${PIP_ARGS[*]}"
  timeout "$TIMEOUT" "$PY" -m pip "${PIP_ARGS[@]}" ||
    die 5 "installing jax[cuda12]==$JAX_PIN failed (above); nothing else ran"
fi
PROBE='import jax; d = jax.devices(); print(jax.default_backend(), len(d), d[0].device_kind, sep="|")'
if ! JAX_SEES=$(timeout 120 "$PY" -c "$PROBE" 2>"${TMPDIR:-/tmp}/gpu_check_probe.$$"); then
  JAX_SEES="error|0|$(tail -n 1 "${TMPDIR:-/tmp}/gpu_check_probe.$$")"
fi
PROBE_WARN=$(grep -i -m 1 -E "cuda|gpu|plugin" "${TMPDIR:-/tmp}/gpu_check_probe.$$" || true)
rm -f "${TMPDIR:-/tmp}/gpu_check_probe.$$"
IFS='|' read -r JAX_BACKEND JAX_N JAX_KIND <<<"$JAX_SEES"
if [[ $JAX_BACKEND != "$PLATFORM" ]]; then
  how="install the CUDA build: drop --skip-install, or pip install \"jax[cuda12]==$JAX_PIN\""
  [[ $SKIP_INSTALL -eq 1 ]] || how="check that the driver supports CUDA 12 (nvidia-smi's 'CUDA Version')"
  die 5 "JAX sees no GPU: its backend is '$JAX_BACKEND' ($JAX_KIND) although nvidia-smi lists $N_GPUS" \
    "${PROBE_WARN:+(JAX said: $PROBE_WARN) }- $how. Nothing was written."
fi
LAB_COUNTS=("$JAX_N")
[[ $JAX_N -eq 1 ]] || LAB_COUNTS+=("$N_ONE")

mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "== JAX sees $JAX_N x $JAX_KIND; results go to $OUT"
"$PY" -c "from course_lib.devices import setup_devices; print(setup_devices($JAX_N, platform='$PLATFORM'))" |
  tee "$OUT/device_report.txt"

# ---- hardware metadata --------------------------------------------------------------------------------
"$NVIDIA_SMI" >"$OUT/nvidia-smi.txt" 2>&1 || true
"$NVIDIA_SMI" topo -m >"$OUT/nvidia-smi-topo.txt" 2>&1 || true
"$PY" -c "import jax; jax.print_environment_info()" >"$OUT/jax_environment.txt" 2>&1 || true
GPU_CSV="$GPU_CSV" QUERY="$QUERY" ARGS="$ORIG_ARGS" "$PY" - "$OUT/hardware.json" <<'EOF'
import datetime, importlib.metadata as md, json, os, platform, re, subprocess, sys
def out(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
import jax
fields = os.environ["QUERY"].split(",")
gpus = [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in os.environ["GPU_CSV"].splitlines()]
smi = open(os.path.join(os.path.dirname(sys.argv[1]), "nvidia-smi.txt")).read()
cuda = re.search(r"CUDA Version:\s*([0-9.]+)", smi)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), None)
meta = {
    "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "git_commit": out("git", "rev-parse", "HEAD"),
    "git_dirty": bool(out("git", "status", "--porcelain", "--untracked-files=no")),
    "gpus": gpus,
    "driver_version": gpus[0].get("driver_version") if gpus else None,
    "cuda_version_driver": cuda.group(1) if cuda else None,
    "jax_backend": jax.default_backend(),
    "jax_devices": [str(d) for d in jax.devices()],
    "device_kind": jax.devices()[0].device_kind,
    "versions": {d: version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                                         "nvidia-cudnn-cu12", "nvidia-cublas-cu12", "nvidia-nccl-cu12",
                                         "flax", "optax", "numpy")},
    "python": platform.python_version(),
    "host_cpus": os.cpu_count(),
    "cpu_model": cpu,
    "jax_default_matmul_precision": jax.config.jax_default_matmul_precision or "default",
    "environment": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                    "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES")},
    "gpu_check_arguments": os.environ["ARGS"],
}
json.dump(meta, open(sys.argv[1], "w"), indent=2)
print("hardware metadata:", sys.argv[1])
EOF

# ---- 4. GPU tests, 5. the lab: each step runs, its status is recorded ------------------------------------
SUMMARY=()
FAILED=0
step() { # step NAME OK_EXIT COMMAND...: run, record status and seconds, go on
  local name=$1 ok=$2 t0=$SECONDS rc=0
  shift 2
  echo "== $name: $*"
  timeout "$TIMEOUT" "$@" || rc=$?
  local status=passed
  [[ $ok -eq 0 || $rc -ne $ok ]] || status="skipped (no GPU: a rehearsal)" rc=0
  if [[ $rc -eq 124 ]]; then
    status="FAILED (over --timeout $TIMEOUT s)"
  elif [[ $rc -ne 0 ]]; then
    status="FAILED (exit $rc)"
  fi
  [[ $rc -eq 0 ]] || FAILED=1
  SUMMARY+=("$(printf '%-24s %-40s %5d s' "$name" "$status" $((SECONDS - t0)))")
}
step "gpu tests" "$TESTS_OK" env COURSE_REQUIRE_GPU=$REQUIRE_GPU COURSE_GPU_RESULTS_DIR="$OUT" \
  "$PY" -m pytest -m gpu tests/test_gpu.py -n 0 -p no:cacheprovider -rA --junitxml="$OUT/pytest_gpu.xml"
for n in "${LAB_COUNTS[@]}"; do
  dir="$OUT/lab-$n$PLATFORM"
  mkdir -p "$dir"
  args=(-p n_devices "$n" -p platform $PLATFORM -p profile $PROFILE -p results_dir "$dir" -p overwrite True)
  for kv in ${LAB_PARAMS[@]+"${LAB_PARAMS[@]}"}; do args+=(-p "${kv%%=*}" "${kv#*=}"); done
  step "lab on $n $PLATFORM(s)" 0 "$PY" -m papermill notebooks/08_lab.ipynb "$dir/08_lab.ipynb" -k python3 \
    --cwd notebooks --log-output --no-progress-bar "${args[@]}"
done

for nb in "${TRANSFORMER_NOTEBOOKS[@]}"; do # each once on every GPU: its asserts, its printed figures
  step "$nb on ${LAB_COUNTS[0]} $PLATFORM(s)" 0 "$PY" -m papermill "notebooks/$nb.ipynb" "$OUT/$nb.ipynb" \
    -k python3 --cwd notebooks --log-output --no-progress-bar -p n_devices "${LAB_COUNTS[0]}" -p platform $PLATFORM
done

TOTAL=$((SECONDS - T_START))
{
  echo "GPU check of $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $JAX_N x $JAX_KIND, $(date -u +%FT%TZ)"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total $TOTAL s (target: under 300 s)"
  "$PY" - "$OUT" <<'EOF' || echo "(no figures: the tests and the lab wrote nothing readable)"
# The figures to read first: parity per precision, then each lab run's throughput and memory.
import json, pathlib, sys
import pandas as pd
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("gpu_test_*.json")):
    r = json.loads(f.read_text())
    if "strategies" in r:
        ok = [v for v in r["strategies"].values() if "error" not in v]
        worst = {m: max((v[m] for v in ok), default=float("nan")) for m in
                 ("trajectory_rel", "trajectory_all_rel", "one_step_loss_rel", "one_step_update_rel")}
        print(f"parity {f.stem[9:]:16s} (matmul {r['matmul_precision']}, {r['n_devices']} x {r['device_kind']}): worst over "
              + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
              + f"; {len(r['strategies']) - len(ok)} strategies failed to run")
columns = ["strategy", "n_devices", "mesh", "samples_per_s", "step_time_s", "mfu", "peak_device_bytes",
           "bytes_per_device", "final_loss"]
for csv in sorted(out.glob("lab-*/lab_results.csv")):
    df = pd.read_csv(csv, comment="#")
    print(f"\n{csv.relative_to(out)}:")
    print(df[[c for c in columns if c in df.columns]].to_string(index=False))
EOF
} | tee "$OUT/summary.txt"
echo "results: $OUT"
exit "$FAILED"
