"""``python -m benchmarks.lora_finetune``: the LoRA fine-tuning loop, each step timed (:mod:`benchmarks.studies.lora_finetune`)."""

import sys

from benchmarks.studies.lora_finetune import main

if __name__ == "__main__":
    sys.exit(main())
