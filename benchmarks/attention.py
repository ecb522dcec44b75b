"""The attention benchmark of docs/benchmarks/attention/index.md; the same code as `relpos bench`.

    python benchmarks/attention.py --json docs/benchmarks/attention/forward.json --markdown docs/benchmarks/attention/forward.md
"""

import sys

from relpos.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
