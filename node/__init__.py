"""Murmuration's process: the ``node`` CLI and the daemon it runs. ``README.md`` (How it fits
together) maps the files; ``node.daemon`` builds the parts."""
