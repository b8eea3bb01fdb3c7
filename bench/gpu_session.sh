#!/usr/bin/env bash
# Everything a lent GPU machine checks, in one command (docs/gpu.md: the recipe).
#
#   bash bench/gpu_session.sh OUTDIR            # on the GPU machine, about 12 minutes at most
#   DRY=1 bash bench/gpu_session.sh OUTDIR      # here: the same steps on CPU, tiny sizes
#   ONLY="attention tile" bash bench/gpu_session.sh OUTDIR   # some steps (a rerun, or a
#                                               # machine that caps one command at 10 minutes)
#
# Each step has its own time limit and log under OUTDIR, so one that hangs or
# crashes leaves the others' results: the main job (examples/run.py, CUDA-host
# placement), the attention kernels against SDPA's flash kernel (fp16 and bf16,
# sequence 4096, head dimensions 64 and 128, causal and not, forward and
# forward + backward), the other tile kernels, the runtime kernels and the fused
# all-reduce, the training wrappers against their torch peers, then the layout
# autotuner's 1-rank comparison (bench/layout_autotune.py).
set -u
out=${1:?usage: bench/gpu_session.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
site=
if [ -d .whl ]; then  # libcst, which the machine's python lacks (docs/gpu.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && site=:/tmp/site
fi
export PYTHONPATH=$PWD$site PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# macrogen.kernels from source, as an installed wheel (or an editable install) has it
$py -c "import macrogen.kernels" 2>/dev/null || ln -sfn ../kernels macrogen/kernels
dry=${DRY:+--dry-run}

step() {  # step NAME SECONDS COMMAND...: its output to OUTDIR/NAME.txt, its status to status.txt
  local name=$1 limit=$2
  shift 2
  case " ${ONLY:-$name} " in *" ${name%%-*} "*) ;; *) return ;; esac
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/status.txt"
}

{ nvidia-smi -L 2>&1; $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$out/status.txt" 2>&1
step run 60 $py examples/run.py --steps 3
step attention 330 $py bench/gpu.py $dry --only attention
step tile 170 $py bench/gpu.py $dry --only tile
step kernels 50 $py bench/gpu.py $dry --only kernels fused_allreduce
step training 150 $py bench/gpu.py $dry --only training
if [ -n "$dry" ]; then dims=64; else dims=${DIMS:-1024}; fi
for dim in $dims; do
  step "layout-$dim" 110 $py bench/layout_autotune.py --world-sizes 1 --rounds 3 --dim "$dim" \
    --json "$out/layout-$dim.json" --plot "$out/layout-$dim.png"
done
