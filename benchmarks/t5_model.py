"""The T5 model benchmark of docs/transformers.md (transformers eager / sdpa vs relpos.hf.accelerate).

    python benchmarks/t5_model.py --json docs/bench-t5.json --markdown docs/bench-t5.md
"""

import sys

from relpos.hf.bench import main

if __name__ == "__main__":
    sys.exit(main())
