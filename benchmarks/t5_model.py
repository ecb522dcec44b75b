"""The model benchmark of docs/integrations/*.md: transformers eager / sdpa vs relpos.hf.accelerate, per family.

    python benchmarks/t5_model.py --json docs/benchmarks/t5-family/t5.json --markdown docs/benchmarks/t5-family/t5.md
    OMP_NUM_THREADS=1 python benchmarks/t5_model.py --family bloom --lengths 2048 --batches 2 \
        --modes forward,train,generate --rounds 2 --d-model 512 --heads 8 --layers 2 \
        --json docs/benchmarks/alibi-families/bloom.json --markdown docs/benchmarks/alibi-families/bloom.md

``--family`` is one of relpos.hf.bench.BUILDERS (t5, bloom, mpt, falcon, switch_transformers, pop2piano,
pix2struct, udop, longt5); a family that relpos.hf.accelerate refuses here is skipped with its message.
"""

import sys

from relpos.hf.bench import main

if __name__ == "__main__":
    sys.exit(main())
