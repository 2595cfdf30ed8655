"""Plug-ins: quantobs' observers inside the toolkits users already run.

Each module registers our observers where its toolkit looks them up, and
importing it is the whole set-up (importing twice is harmless):

* `quantobs.integrations.llmcompressor`: llm-compressor 0.14's `Observer`
  registry (`quantobs_<name>` in a recipe's `observer`);
* `quantobs.integrations.quark`: AMD Quark 0.13's observer sets, so that
  `ModelQuantizer` takes `quantobs.quark` observer classes;
* `quantobs.integrations.torchao`: torchao's PT2E flow
  (`prepare_pt2e` / `convert_pt2e`) with `quantobs.torch_ao` observers.

A module whose toolkit is not installed raises an `ImportError` naming the
extra to install.
"""
