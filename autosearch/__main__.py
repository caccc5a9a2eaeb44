import sys

from autosearch.cli import main

sys.exit(main())
