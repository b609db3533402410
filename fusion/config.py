"""`FusionConfig`: what the user asked of the fused all-reduce (plain values, from ServerArgs)."""
from __future__ import annotations

from dataclasses import dataclass

from arfusion.fusion.options import FLASHINFER, FUSION_BACKENDS

# Entries of the (layer_id, batch_size) decision LRU: layers x distinct batch sizes that stay cached
# (32 layers x 128 batch sizes).
DEFAULT_CACHE_SIZE = 4096
NO_TABLE = "none"  # table_path value: no measured table, the built-in rule decides


@dataclass(frozen=True)
class FusionConfig:
    enabled: bool = False
    backend: str = FLASHINFER  # one of `fusion.options.FUSION_BACKENDS`
    max_tokens: int = 2048  # largest batch (tokens) the flashinfer workspace takes
    cache_size: int = DEFAULT_CACHE_SIZE  # bound of the (layer_id, batch_size) decision cache
    # fusion stays on; every strategy the dispatch may pick follows one canonical numeric recipe
    # (fusion.reference), so switching strategies by batch size changes no bit (fusion.backends.deterministic)
    deterministic: bool = False
    one_shot_max_input_bytes: int | None = None  # overrides the one-shot/two-shot threshold
    launch_with_pdl: bool = True  # launch the flashinfer kernel with programmatic dependent launch
    table_path: str | None = None  # measured strategy table; None: the packaged one; "none": no table
    # rows the fused two-shot buffer holds (larger batches run in chunks of it); None: max_tokens.
    # The engine's largest prefill: eager chunks of a few thousand rows are host-bound.
    symm_max_tokens: int | None = None
    # measure the strategies at start-up when no table has this configuration (and no table_path
    # was given); the result is cached in tuning_cache_dir (None: ~/.cache/arfusion)
    tune_at_startup: bool = True
    tuning_cache_dir: str | None = None
    tuning_budget_s: float = 20.0  # past it the measurement is abandoned and the built-in rule decides

    def __post_init__(self) -> None:
        if self.backend not in FUSION_BACKENDS:
            raise ValueError(f"fusion backend must be one of {FUSION_BACKENDS}, got {self.backend!r}")
        if self.max_tokens < 1:
            raise ValueError(f"fusion max_tokens must be >= 1, got {self.max_tokens}")
        if self.cache_size < 1:
            raise ValueError(f"fusion cache_size must be >= 1, got {self.cache_size}")
        if self.tuning_budget_s <= 0:
            raise ValueError(f"fusion tuning_budget_s must be > 0, got {self.tuning_budget_s}")
        if self.symm_max_tokens is not None and self.symm_max_tokens < 1:
            raise ValueError(f"fusion symm_max_tokens must be >= 1, got {self.symm_max_tokens}")
