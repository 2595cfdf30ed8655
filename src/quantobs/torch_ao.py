"""`quantobs.torch_ao`: the module `quantobs.faces.torch_ao` (a shorter name)."""

import sys

from quantobs.faces import torch_ao as _face

sys.modules[__name__] = _face
