#!/usr/bin/env bash
# Everything a session measures when one GPU (an H200) is lent, in one call of the device tool:
#
#     run(command="bash benchmarks/gpu/lent_machine.sh", timeout_s=590)
#
# In the order of what matters most, each part under its own time limit so that one stuck part cannot take the whole
# lease: the 0.5B Llama (fsdp2 + compile against Lightning auto + compile, then selective and whole-block activation
# checkpointing), FP8 tensorwise against bf16 + compile at Llama-3-8B width (8 layers), ZeRO++'s quantization kernels
# on CUDA, then the CUDA-marked tests. Results land in $OUT (the device tool's folder; benchmarks/results/gpu when it
# is unset) as each part ends, so a run cut short still returns what it measured. About 8 minutes on one H200.
set -uo pipefail
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python=python3

$python - >"$out/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as m, torch
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("torch", "lightning", "transformers", "torchao", "triton"):
    try:
        print(f"{name}: {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
cat "$out/versions.txt"

steps=(--warmup 4 --steps 12)
timeout 260 $python -m benchmarks.run --gpu --sizes 0.5b "${steps[@]}" --out "$out/llama_0_5b" \
    --setups auto_compile,fsdp2_compile,fsdp2_sac_compile,fsdp2_ac_compile
timeout 170 $python -m benchmarks.run --gpu --sizes 8b-width "${steps[@]}" --out "$out/llama_8b_width" \
    --setups fsdp2_compile,fsdp2_fp8_tensorwise_compile
timeout 50 $python -m benchmarks.zeropp_quantization --device cuda 2>&1 | tee "$out/zeropp_quantization.md"
timeout 90 $python -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tail -15 | tee "$out/cuda_tests.txt"
