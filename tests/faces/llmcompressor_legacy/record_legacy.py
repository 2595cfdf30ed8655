"""Record llm-compressor 0.7.1's legacy observers on the cases of
`low_precision_cases.py` into `legacy_0_7_1.safetensors` (read by
`test_low_precision.py`). Not a test; run by hand where the legacy
packages can be imported, e.g.::

    pip download --no-deps llmcompressor==0.7.1 compressed-tensors==0.11.0 \\
        frozendict -d /tmp/legacy
    cd /tmp/legacy && mkdir site && for w in *.whl; do unzip -qo $w -d site; done
    LEGACY_SITE=/tmp/legacy/site python \\
        tests/faces/llmcompressor_legacy/record_legacy.py

llm-compressor 0.7.1's package `__init__` needs transformers 4; only its
`observers` subpackage is loaded here (the package's path set by hand), with
compressed-tensors 0.11 from `LEGACY_SITE` ahead of any other.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent
OUT = HERE / "legacy_0_7_1.safetensors"


def _load_legacy() -> tuple[type, type, type]:
    site = os.environ["LEGACY_SITE"]
    sys.path.insert(0, site)
    package = types.ModuleType("llmcompressor")
    package.__path__ = [os.path.join(site, "llmcompressor")]
    sys.modules["llmcompressor"] = package
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs

    if not compressed_tensors.__file__.startswith(site):
        raise RuntimeError(f"compressed-tensors not from {site}")
    from llmcompressor.observers.min_max import MinMaxObserver
    from llmcompressor.observers.mse import MovingAverageMSEObserver

    return QuantizationArgs, MinMaxObserver, MovingAverageMSEObserver


def main() -> None:
    args_cls, minmax, mse = _load_legacy()
    sys.path.insert(0, str(HERE))
    from low_precision_cases import CASES, DTYPES, batches

    found: dict[str, torch.Tensor] = {}
    for case, (kind, kwargs, options) in CASES.items():
        for dtype_name, dtype in DTYPES.items():
            cls = minmax if kind == "minmax" else mse
            observer = cls(args_cls(**kwargs), **options)
            for i, x in enumerate(batches(dtype)):
                scale, zero_point = observer(x)
                found[f"{case}/{dtype_name}/{i}/scale"] = scale.clone().contiguous()
                found[f"{case}/{dtype_name}/{i}/zero_point"] = (
                    zero_point.clone().contiguous()
                )
    save_file(found, str(OUT), metadata={"llmcompressor": "0.7.1"})
    print(f"wrote {len(found)} tensors to {OUT}")


if __name__ == "__main__":
    main()
