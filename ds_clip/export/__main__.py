"""python -m ds_clip.export: the same as ds-clip-export."""

import sys

from ds_clip.export.openclip import main

sys.exit(main())
