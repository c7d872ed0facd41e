"""``python -m hf_dspark.cli <command>``: what ``accelerate launch -m hf_dspark.cli train ...`` runs."""

import sys

from . import main

sys.exit(main())
