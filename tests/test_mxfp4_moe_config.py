"""Which launches gpt-oss's experts take (layers/moe/kernels/mxfp4_moe_config.py, no GPU or
interpreter needed): the matrix-vector launches for MXFP4 weights up to GEMV_MAX_SLOTS slots
outside batch-invariant mode, the grouped launches otherwise (past those slots, the decode table's
entry in either mode); their configuration limits."""
import pytest

from arfusion.layers.moe.kernels import mxfp4_moe_config as mc

BYTES = dict(block_m=16, block_n_gate_up=32, block_k_gate_up=32, block_n_down=64, block_k_down=32, num_warps=4,
             num_stages=2)


@pytest.mark.parametrize("slots", [1, 4, mc.GEMV_MAX_SLOTS])
def test_mxfp4_decode_sizes_take_the_matrix_vector_launches(slots):
    assert mc.experts_block_config(slots, 32, True) == mc.GEMV_CONFIG
    assert mc.GEMV_CONFIG.gemv


@pytest.mark.parametrize(("slots", "mxfp4", "deterministic"), [
    (mc.GEMV_MAX_SLOTS + 1, True, False),  # past the bound
    (4, False, False),  # bf16-form weights
    (4, True, True),  # batch-invariant mode keeps the grouped launches
])
def test_other_calls_take_the_grouped_launches(slots, mxfp4, deterministic):
    assert not mc.experts_block_config(slots, 32, mxfp4, deterministic).gemv


def test_decode_table_entry_serves_either_mode_past_the_matrix_vector_slots(monkeypatch):
    entry = mc.Mxfp4MoEConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32,
                              block_k_down=128, num_stages=5)
    monkeypatch.setattr(mc, "DECODE_CONFIGS", ((8.0, entry),))
    assert mc.experts_block_config(64, 32, True) == entry
    assert mc.experts_block_config(64, 32, True, deterministic=True) == entry
    assert mc.experts_block_config(2048, 32, True) != entry  # past the table: the prefill tiles


def test_matrix_vector_launches_have_no_k_splits():
    bad = mc.Mxfp4MoEConfig(**{**mc.GEMV_CONFIG.__dict__, "split_k_down": 2})
    with pytest.raises(ValueError, match="gemv has no K splits"):
        mc.check_config(bad, mxfp4=True)
    mc.check_config(mc.GEMV_CONFIG, mxfp4=True)  # block_m 1 without swap is fine for gemv


@pytest.mark.parametrize(("fields", "message"), [
    (dict(split_k_down=0), "split_k_down must be at least 1"),
    (dict(num_stages_down=-1), "num_stages_down must be at least 0"),
    (dict(num_warps=0), "num_warps must be at least 1"),
    (dict(early_weights=True), "early_weights is a variant of the matrix-vector launches"),
])
def test_check_config_refuses(fields, message):
    with pytest.raises(ValueError, match=message):
        mc.check_config(mc.Mxfp4MoEConfig(**{**BYTES, **fields}), mxfp4=True)


def test_check_config_allows_per_launch_warps_and_stages():
    mc.check_config(mc.Mxfp4MoEConfig(**BYTES, num_warps_down=8, num_stages_down=5), mxfp4=True)
