"""One module per CLI subcommand, each with `register(subparsers)` setting `func`."""
