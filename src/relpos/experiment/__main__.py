"""``python -m relpos.experiment [tasks] ...``: the experiment without the ``relpos`` launcher (torchrun)."""

import os

from .._process import exit_process
from .cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's processes end without teardown (relpos._process: why)
    exit_process(code)
raise SystemExit(code)
