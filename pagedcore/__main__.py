"""``python -m pagedcore``: the `pagedcore` command."""

from pagedcore.cli import main

if __name__ == "__main__":
    main()
