"""``python -m colossal.cli`` runs the ``colossal`` command (handy when it is not on PATH)."""

from colossal.cli.main import main

if __name__ == "__main__":
    main()
