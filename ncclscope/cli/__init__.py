"""The `ncclscope` command line (a face): parse (`parser.py`), read inputs (`inputs.py`),
run a subcommand (`commands.py`), print text or JSON (`output.py`); `main.py` is the entry point."""
