"""`python -m layerwise_hf SCRIPT [ARGS...]`: run a training script unchanged with `layerwise_hf.install()` in effect
(see `layerwise_hf.integrations.launcher`)."""

import sys

from .integrations.launcher import main

if __name__ == "__main__":
    sys.exit(main())
