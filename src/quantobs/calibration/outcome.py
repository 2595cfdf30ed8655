"""`CalibrationReport`: what a `calibrate` call did (tokens per observer and
per expert, observers that fell back, batches, time)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CalibrationReport"]


@dataclass
class CalibrationReport:
    """What a `calibrate` call did.

    Attributes:
        modules: names of the modules whose qparams were written.
        tokens: tokens each activation / attention observer has seen in all
            (`"{module}.{base}"` -> count; the legacy token count, for every
            activation shape), summed over processes when synced.
        empty: observers that saw no data (their qparams fell back).
        batches: batches run by this call (this process's; 0 when no
            observer needs data: weight-only schemes).
        seconds: wall time of this call.
        experts: real tokens the router sent to each observed MoE expert
            (`"...mlp.experts.3"` -> count) by the batches of every calibrate
            call since attach (this process's; not kept by `save_state`;
            empty when no batch ran).
        unrouted: experts no token was routed to (count 0).
        fallen_back: experts some of whose observers fell back to their
            siblings' range (`on_empty="fallback"`).
    """

    modules: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    empty: list[str] = field(default_factory=list)
    batches: int = 0
    seconds: float = 0.0
    experts: dict[str, int] = field(default_factory=dict)
    unrouted: list[str] = field(default_factory=list)
    fallen_back: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        data = (
            f"on {self.batches} batches"
            if self.batches or self.tokens
            else "from their weights alone (no observer needs data)"
        )
        lines = [
            f"calibrated {len(self.modules)} modules {data} in {self.seconds:.2f} s"
        ]
        if self.tokens:
            counts = sorted(self.tokens.values())
            lines.append(
                f"tokens per observer: min {counts[0]}, max {counts[-1]} "
                f"({len(counts)} observers)"
            )
        if self.experts:
            counts = sorted(self.experts.values())
            lines.append(
                f"tokens per expert: min {counts[0]}, max {counts[-1]} "
                f"({len(counts)} experts)"
            )
        if self.unrouted:
            lines.append(f"experts no token was routed to: {', '.join(self.unrouted)}")
        if self.fallen_back:
            lines.append(
                f"experts with siblings' ranges: {', '.join(self.fallen_back)}"
            )
        if self.empty:
            lines.append(f"saw no data (fallback range): {', '.join(self.empty)}")
        return "\n".join(lines)
