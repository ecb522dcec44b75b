"""``python -m relpos.experiment [tasks] ...``: the experiment without the ``relpos`` launcher (torchrun)."""

from .cli import main

raise SystemExit(main())
