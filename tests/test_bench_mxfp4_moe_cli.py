"""benchmarks/kernels/bench_mxfp4_moe.py's command line without a GPU: ``--configs`` reaches every
`Mxfp4MoEConfig` field (booleans as 0 / 1, the rest integers) and a row's label names each field
that differs from the default."""
import dataclasses

import pytest

from arfusion.benchmarks.kernels.bench_mxfp4_moe import describe, parse_overrides
from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig, experts_block_config


def test_every_config_field_is_reachable_and_labelled():
    base = experts_block_config(4, 32, True)
    changed = {f.name: (not getattr(base, f.name)) if f.type in (bool, "bool") else getattr(base, f.name) + 1
               for f in dataclasses.fields(Mxfp4MoEConfig)}
    text = ",".join(f"{name}={int(value)}" for name, value in changed.items())
    assert parse_overrides(text) == changed
    label = describe({"default": False, "changed": changed})
    assert len(label.split()) == len(changed)
    assert "split=2" in label and "w2=1" in label and "st2=1" in label


def test_unknown_field_is_refused():
    with pytest.raises(Exception, match="NAME=VALUE"):
        parse_overrides("split_k_gate=2")
