#!/usr/bin/env bash
# The GPU check on the lent GPU machine, run from the repository root:
#
#     bash bench/gpu_run.sh            # (the device tool's command; carry .gpu-wheels)
#
# That machine has no network and an older transformers (5.17; qcache needs >= 5.24), so the wheels in
# ${GPU_WHEELS:-.gpu-wheels}/ (transformers and what it needs beyond the machine's own packages, made here with
# `pip download --no-deps`) are installed offline into /tmp/site, which goes first on PYTHONPATH, with this checkout
# (qcache, eval) after it. Then bench/gpu_check.py runs and writes $OUT/gpu-check.json, .md and .log (the device tool
# copies back what is under $OUT; without OUT: docs/results/). Extra arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-.gpu-wheels}
out_dir=${OUT:-docs/results}
shopt -s nullglob
found=("$wheels"/*.whl)
if [ ${#found[@]} -eq 0 ]; then
    echo "gpu_run.sh: no wheels in $wheels/ (make them with pip download --no-deps, see the report of bench/gpu_check.py)" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${found[@]}"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 - <<'EOF'
import importlib.metadata as md
import torch
names = ["torch", "transformers", "huggingface_hub", "kernels", "tokenizers", "safetensors", "triton", "accelerate"]
print("versions:", ", ".join(f"{n} {md.version(n)}" for n in names))
print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import qcache  # refuses a transformers outside the supported range
EOF
mkdir -p "$out_dir"
python3 bench/gpu_check.py --out "$out_dir/gpu-check" "$@" 2>&1 | tee "$out_dir/gpu-check.log"
