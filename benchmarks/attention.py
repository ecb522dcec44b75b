"""The attention benchmark of docs/benchmarks.md; the same code as `relpos bench`.

    python benchmarks/attention.py --json docs/bench.json --markdown docs/bench.md
"""

import sys

from relpos.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
