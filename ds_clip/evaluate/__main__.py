"""python -m ds_clip.evaluate: the same as ds-clip-eval."""

import sys

from ds_clip.evaluate.cli import main

sys.exit(main())
