"""The ``kvpack`` command line: thin subcommands, each a call into the library."""
