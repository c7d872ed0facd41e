"""The ``hf-dspark`` console script (``[project.scripts]``).

Importing ``hf_dspark`` registers the drafter with transformers' Auto classes, which loads torch and transformers'
modeling code: seconds that ``hf-dspark --help`` and a refused flag do not need. This module sits outside the package
so that it runs before the package's ``__init__``: it asks that import to defer the registration, and
``hf_dspark.cli.main`` registers right before a command runs. The request is an environment variable set only around
the import and removed at once, so no library import (nor any child process) ever sees it. ``python -m hf_dspark.cli``
imports the package as a library does: it registers at import.
"""

import os
import sys

# hf_dspark.DEFER_REGISTRATION (spelled out: importing hf_dspark to read it would already decide)
DEFER_REGISTRATION = "HF_DSPARK_DEFER_REGISTRATION"


def main() -> int:
    os.environ[DEFER_REGISTRATION] = "1"
    try:
        from hf_dspark.cli import main as cli_main
    finally:
        del os.environ[DEFER_REGISTRATION]
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
