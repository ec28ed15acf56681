#!/usr/bin/env bash
# Every GPU line of the saturation, many-adapters and structured-outputs work in one device
# call, most important first; each stage has its own time limit, so a call cut short still
# returns what finished. Logs and step traces are packed into $1/logs.tgz (default: $OUT,
# else ./saturation-out); results merge into bench/results/<date>-<gpu>.json, copied to $1. The stages
# take ~16 min in all, more than one device command may run (10 min): name the stages of
# each call, e.g. `serving decode256 decode256_plain_sort structured` (~8 min), then
# `online churn` (~8 min), `profile_lora64` (~4 min); none named runs them all.
#
#     bash bench/saturation_call.sh [DIR [STAGE ...]]
#
# On a device image without xgrammar (a base dependency), carry its wheels in .whl/ and
# install them first: python3 -m pip install -q --no-deps --no-index .whl/*.whl
set -u
dest=${1:-${OUT:-saturation-out}}
shift $(( $# > 0 ? 1 : 0 ))
only=" $* "
out=$dest/run  # packed into $dest/logs.tgz at the end
mkdir -p "$out/traces"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$out/commit.txt"

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t0))s; last lines:"
  tail -n 4 "$out/$name.log" | cut -c1-300
}

# saturation and many adapters: one engine for all four (each row printed as it finishes)
stage serving 360 python3 bench/serving.py --scenarios offline_base offline_lora64 \
  offline_lora1000 offline_base_budget_only --trace-dir "$out/traces"
# decode at batch 256: base against the HBM roofline, 64 adapters against their byte bound
stage decode256 60 python3 bench/decode.py --batch 256 --no-peft --adapters 64
# the same with the plain slot sort (the segment-aligned order's A/B)
stage decode256_plain_sort 60 python3 bench/decode.py --batch 256 --no-peft --adapters 64 \
  --override metrale.ops.lora_launch.SEGMENTS=0
# half the batch under a JSON schema, 16 adapters, against the same batch unconstrained
stage structured 60 python3 bench/decode.py --model llama3-8b --only-structured --no-peft
# the default against the budget alone (the same warmed-up engine), the online run after
# them at 80% of the default's offline request rate
stage online 330 python3 bench/serving.py --scenarios offline_base offline_base_budget_only \
  online_base --seconds 120 --trace-dir "$out/traces"
# where a LoRA mixed step's time goes (the kernel table of 20 saturated steps; #49's main loss)
stage profile_lora64 240 python3 bench/serving.py --scenarios offline_lora64 --profile 20 \
  --profile-scenario offline_lora64 --no-write
# the long prompt's ITL
stage churn 90 python3 bench/churn.py --model llama3.2-1b --long-prompt-only --long-prompt-run mixed
# at most 8 files come back from a device call: this run's results JSON (the newest), the
# logs and the traces in one archive
cp "$(ls -t bench/results/*.json | head -n 1)" "$dest/" 2>/dev/null
tar czf "$dest/logs.tgz" -C "$out" . && rm -rf "$out"
