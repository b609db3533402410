"""Which launches gpt-oss's experts take (layers/moe/kernels/mxfp4_moe_config.py, no GPU or
interpreter needed): the matrix-vector launches for MXFP4 weights up to GEMV_MAX_SLOTS slots
outside batch-invariant mode, the grouped launches otherwise; their configuration limits."""
import pytest

from arfusion.layers.moe.kernels import mxfp4_moe_config as mc


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


def test_matrix_vector_launches_have_no_k_splits():
    for field in ("split_k_gate_up", "split_k_down"):
        bad = mc.Mxfp4MoEConfig(**{**mc.GEMV_CONFIG.__dict__, field: 2})
        with pytest.raises(ValueError, match="gemv has no K splits"):
            mc.check_config(bad, mxfp4=True)
    mc.check_config(mc.GEMV_CONFIG, mxfp4=True)  # block_m 1 without swap is fine for gemv
