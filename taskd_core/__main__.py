"""``python -m taskd_core`` is the ``taskd`` command."""

from taskd_core.cli import main

raise SystemExit(main())
