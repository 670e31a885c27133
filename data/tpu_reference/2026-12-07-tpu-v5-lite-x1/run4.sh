#!/usr/bin/env bash
# one TPU call of the full re-run: bash .tpu/run4.sh TAG "NOTEBOOKS" [programs]
set -u
TAG=$1 NBS=$2 PROGS=${3:-}
R=/tmp/r4-$TAG; mkdir -p $OUT
SITE=$PWD/build/tpu-site
PY=$(cd / && python3 -c 'import sys;print(sys.executable)')
pack() { tar czf $OUT/r4-$TAG.tgz -C /tmp r4-$TAG r4-$TAG.log 2>/dev/null; }
INST=(); [[ -d $SITE/flax ]] && INST=(--skip-install)
{
date -u; echo "site: ${INST[*]:-fresh install}"
if [[ -n $NBS ]]; then
  bash tools/tpu_check.sh --out $R/nb --site $SITE "${INST[@]}" --wheelhouse .whl-tpu --steps "$([[ $TAG == a ]] && echo 'tests notebooks' || echo notebooks)" --notebooks "$NBS" --timeout 200; echo "check rc=$?"
fi
if [[ -n $PROGS ]]; then
  mkdir -p $R; date -u
  PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD timeout 200 $PY tools/tpu_programs.py --out $R/programs --jobs 6; echo "programs rc=$?"; pack
fi
date -u
} > /tmp/r4-$TAG.log 2>&1
pack; tail -60 /tmp/r4-$TAG.log
