"""``python -m node``: the same CLI as the ``node`` and ``murmur`` commands."""

from node.cli import main

raise SystemExit(main())
