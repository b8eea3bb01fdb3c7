"""The CLI's subcommands, one module each (found by ``macrogen.cli``)."""
