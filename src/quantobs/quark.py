"""`quantobs.quark`: the module `quantobs.faces.quark` (a shorter name)."""

import sys

from quantobs.faces import quark as _face

sys.modules[__name__] = _face
