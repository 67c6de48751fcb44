"""A larger local corpus for the convergence study: the docstrings of the installed packages.

The embedded corpus (the standard library's docstrings, ``node/data/stdlib_corpus.py``)
holds about 1.9M training tokens, so a 5M-token study passes over it more than twice and a
15M-token one eight times. This writes the docstrings of every package in this Python's
site-packages (torch, numpy, aiohttp and the rest: tens of millions of tokens of the same
kind of text, nothing downloaded) as a .jsonl for ``data.path``::

    .venv/bin/python -m bench.site_corpus /tmp/site-corpus.jsonl
    .venv/bin/python -m bench.convergence --set data.path=/tmp/site-corpus.jsonl ...

What it holds depends on what is installed, so runs on it compare with each other, not with
another machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

from node.data.stdlib_corpus import docstring_documents


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the .jsonl to write")
    p.add_argument("--root", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    args = p.parse_args(argv)
    docs = docstring_documents(args.root, "site")
    with args.out.open("w") as f:
        for doc in docs:
            f.write(json.dumps({"id": doc.doc_id, "text": doc.text}) + "\n")
    chars = sum(len(d.text) for d in docs)
    print(f"{len(docs):,} documents, {chars:,} characters -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
