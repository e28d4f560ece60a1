"""``python -m convoy`` is ``convoy``."""

from convoy.cli import main

raise SystemExit(main())
