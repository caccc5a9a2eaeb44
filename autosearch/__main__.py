import sys

try:
    from autosearch.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python is still importing the command line
    print("\nautosearch: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
