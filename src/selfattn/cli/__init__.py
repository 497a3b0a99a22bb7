"""Command-line interface: one module per subcommand, dispatched by :func:`selfattn.cli.main.main`."""
