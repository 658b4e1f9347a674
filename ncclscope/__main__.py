"""`python -m ncclscope ...` is the same as the `ncclscope` console script."""
import sys

from ncclscope.cli.main import main

sys.exit(main())
