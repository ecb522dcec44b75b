"""``python -m relpos.experiment [tasks] ...``: the experiment without the ``relpos`` launcher (torchrun)."""

from .._process import finish
from .cli import main

finish(main())  # under torchrun without teardown (relpos._process: why)
