"""``python -m dmuon``: runs :func:`dmuon._cli.main` (the command line lives in :mod:`dmuon._cli`)."""

import sys

from dmuon._cli import main

__all__ = ["main"]

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # output piped into e.g. `head`, which closed it: stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        sys.exit(141)
