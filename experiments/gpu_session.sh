#!/usr/bin/env bash
# Everything that needs the H200, in the order to run it, each step bounded so that one step's
# failure leaves the others' results. Usage on the device machine, from the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD    # numpy 2.3.5 for numba-cuda
#   bash experiments/gpu_session.sh STEP $OUT
#
# STEP is one of:
#   tests (about 2 min); pools (about 3 min); train (about 8 min);
#   train-paged: the paged allocator's compiled hook, with aliases and 64 pages of slack, beside
#     both PyTorch modes, 5 rounds (about 8 min);
#   confirm-lora: LoRA only, default and that paged setting interleaved four times each, on the
#     same four cores: LoRA's step time moves between processes (about 5 min);
#   hook-cost: LoRA; default, cudaMallocAsync natively and behind PyTorch's hook without and with
#     the GIL, and that paged setting, interleaved three times on the same four cores: where a
#     hooked allocator's time goes (about 8 min);
#   gc-ckpt: ckpt's history recorded and replayed with Python's garbage collector run only
#     between steps: is it why ckpt's replay parts from the GPU run? (about 3 min);
#   snapshots: PyTorch's memory history of the training run's default mode, every variant, for
#     replays of the exact run (about 3 min);
#   offload (about 4 min); offload2 (two GPUs: nvidia-h200-x2, about 2 min); gemm (about 4 min);
#   kernels (about 3 min);
#   dropin: PyTorch's allocator contract per allocator (tests/gpu/test_dropin.py; first call builds
#     the C++ shim, ~13 s; about 3 min);
#   ddp (two GPUs: nvidia-h200-x2): DDP and FSDP2 under default, expandable and paged with aliases,
#     3 interleaved repeats, then pooled step-time ratios (about 8 min);
#   train-offload: the training runtime at 16 blocks 4096 wide, LoRA and full (about 8 min).
# Give each a call of its own (10-minute limit).
set -u
step=${1:?step: tests|pools|train|train-paged|confirm-lora|hook-cost|gc-ckpt|snapshots|offload|offload2|gemm|kernels|dropin|ddp|train-offload}
out=${2:?output folder}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
case "$step" in
  tests)   VMSTOOLKIT_REAL_GPU=1 timeout 300 python3 -m pytest tests/gpu tests/kernels -q 2>&1 | tee "$out/tests.log" ;;
  pools)   timeout 400 python3 experiments/gpu_pools.py --out "$out/pools" 2>&1 | tee "$out/pools.log" ;;
  train)   timeout 560 python3 experiments/train_llama_gpu.py --out "$out/train" --rounds 3 2>&1 | tee "$out/train.log" ;;
  train-paged) timeout 560 python3 experiments/train_llama_gpu.py --out "$out/train-paged" --modes default,expandable,paged:aliases=True+slack_pages=64 --rounds 5 2>&1 | tee "$out/train-paged.log" ;;
  confirm-lora) timeout 560 python3 experiments/train_llama_gpu.py --out "$out/confirm-lora" --variants lora --modes default,paged:aliases=True+slack_pages=64 --repeats 4 --rounds 5 --cpus 4 2>&1 | tee "$out/confirm-lora.log" ;;
  hook-cost) timeout 580 python3 experiments/train_llama_gpu.py --out "$out/hook-cost" --variants lora --modes default,async,hook-async,hook-async-gil,paged:aliases=True+slack_pages=64 --repeats 3 --rounds 5 --cpus 4 2>&1 | tee "$out/hook-cost.log" ;;
  gc-ckpt) timeout 400 python3 experiments/train_llama_gpu.py --out "$out/gc-ckpt" --variants ckpt --modes default,paged --rounds 3 --gc-between-steps --snapshots "$out/gc-ckpt" 2>&1 | tee "$out/gc-ckpt.log"
           python3 experiments/train_steps_replay.py "$out/gc-ckpt/train-ckpt.pickle.gz" --train-jsonl "$out/gc-ckpt/train.jsonl" --mode paged 2>&1 | tee -a "$out/gc-ckpt.log" ;;
  snapshots) timeout 400 python3 experiments/train_llama_gpu.py --out "$out/snapshots" --modes default --rounds 3 --snapshots "$out/snapshots" 2>&1 | tee "$out/snapshots.log" ;;
  offload) OFFLOAD_REPEATS=2 timeout 560 python3 experiments/offload_gpu.py --out "$out/offload" 2>&1 | tee "$out/offload.log" ;;
  offload2) OFFLOAD_REPEATS=2 OFFLOAD_NOTIFY=poll timeout 300 python3 experiments/offload_gpu.py --out "$out/offload-2gpu" --gpus 2 --skip-accelerate 2>&1 | tee "$out/offload-2gpu.log" ;;
  gemm)    timeout 400 python3 experiments/gemm_sweep.py --out "$out/gemm" 2>&1 | tee "$out/gemm.log" ;;
  kernels) timeout 400 python3 experiments/kernels_bench.py --out "$out/kernels" 2>&1 | tee "$out/kernels.log" ;;
  dropin)  VMSTOOLKIT_REAL_GPU=1 VMSTOOLKIT_DROPIN_OUT="$out/dropin.jsonl" timeout 500 python3 -m pytest tests/gpu/test_dropin.py -q 2>&1 | tee "$out/dropin.log" ;;
  ddp)     timeout 520 python3 experiments/ddp_fsdp_gpu.py --out "$out/ddp" --repeats 3 2>&1 | tee "$out/ddp.log"
           for v in ddp fsdp2; do python3 experiments/pool_runs.py "$out/ddp/train.jsonl" --variant $v --mode paged:aliases=True+slack_pages=64 --steps-per-round 4 2>&1 | tee -a "$out/ddp.log"; done ;;
  train-offload) timeout 560 python3 experiments/train_offload_gpu.py --out "$out/train-offload" 2>&1 | tee "$out/train-offload.log" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
