"""Faces: the observer APIs of llm-compressor (legacy), torch.ao and AMD Quark,
as thin adapters over the observer engine."""
