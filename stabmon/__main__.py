"""``python -m stabmon`` runs the command line."""

from stabmon.cli import main

raise SystemExit(main())
