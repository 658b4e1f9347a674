"""`python -m ncclscope ...` is the same as the `ncclscope` console script."""
import sys

from .cli import main

sys.exit(main())
