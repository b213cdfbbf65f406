"""Alias of :mod:`omniwire.peer` for tests: ``python -m omniwire.testing.peer ...``."""

from ..peer import main

if __name__ == "__main__":
    main()
