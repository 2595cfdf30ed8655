"""`python -m quantobs`: the same as the `quantobs` command."""

from quantobs.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
