"""`python -m cli ARGS`: the same as `llm-pretrain ARGS`."""
import sys

from cli.main import main

sys.exit(main())
