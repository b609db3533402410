"""`CheckpointTensors`: the tensors a checkpoint must hold for a model, checked one at a time as
they come and for completeness at the end. The model's ``load_weights`` checks the tensors it is
given; the weight loaders check a file's tensor list (names and shapes from its header) before
any data is read, naming the file."""
from __future__ import annotations

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.hf_layouts import Shapes

SHOWN_MISSING = 5  # missing names listed in the error; the rest are counted


class CheckpointTensors:
    def __init__(self, expected: Shapes, config: ModelConfig) -> None:
        """``expected``: every tensor the model takes (HF name -> full shape) for ``config``."""
        self.expected = expected
        self.config = config
        self.seen: set[str] = set()

    def skipped(self, name: str) -> bool:
        """Whether the model ignores a tensor of this name: rotary ``inv_freq`` buffers, and
        ``lm_head.weight`` when the embeddings are tied."""
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)

    def take(self, name: str, shape: tuple[int, ...]) -> bool:
        """Record one checkpoint tensor; False for one the model skips. ValueError naming the
        tensor for an unexpected or repeated name or a shape the model does not expect."""
        if self.skipped(name):
            return False
        if name not in self.expected:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint: {self.config.architecture} has no such weight")
        if name in self.seen:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        if tuple(shape) != self.expected[name]:
            raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, the model expects {self.expected[name]}")
        self.seen.add(name)
        return True

    def finish(self) -> None:
        """ValueError naming the expected tensors that never came (the first few, and how many)."""
        missing = [n for n in self.expected if n not in self.seen]
        if missing:
            shown = ", ".join(missing[:SHOWN_MISSING])
            more = f", ... ({len(missing)} in all)" if len(missing) > SHOWN_MISSING else ""
            raise ValueError(f"the checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
