"""`python -m tree_attention_edu`: the command line, the same as `tree-attention-edu`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
