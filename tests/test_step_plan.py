"""`RequestTable` and `DecodeBuffers` on CPU: what a CUDA-graph decode step copies into its
static buffer (the plan, then padding), that the table records the new slots, and that a model
decoding through the buffers (row ids over the whole table, a padded batch) gives the logits of
the batch `RequestTable.apply` builds (the plan's rows gathered)."""
from dataclasses import replace

import pytest
import torch

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import ForwardBatch
from arfusion.engine.models.registry import build_model
from arfusion.engine.runtime.step_plan import DecodeBuffers, RequestTable, StepPlan
from arfusion.engine.weights.dummy import dummy_weights
from tests.dist_utils import make_fusion, run_distributed
from tests.tolerances import assert_close

ROWS, CONTEXT, NUM_SLOTS, STEPS = 8, 32, 128, 6
CPU = torch.device("cpu")
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, vocab_size=264, rope_theta=10000.0,
)
SEQ_ROWS = [5, 2, 7]  # not the batch rows 0..2: reading row b instead of row_ids[b] would show
PROMPTS = [[5, 200, 17, 3, 99], [42, 7], [11, 250, 63, 8, 120, 77, 1, 30, 222]]


def decode_plan(rows: list[int], tokens: list[int], slots: list[int], seq_lens: list[int]) -> StepPlan:
    return StepPlan("decode", rows=rows, new_tokens=[[t] for t in tokens], new_slots=[[s] for s in slots],
                    seq_lens=seq_lens)


def test_buffers_hold_the_plan_then_padding_and_the_table_records_new_slots():
    table = RequestTable(ROWS, CONTEXT, CPU)
    buffers = DecodeBuffers(table, 4)
    pad = table.pad_row
    assert buffers.packed.tolist() == [[0] * 4, [0] * 4, [1] * 4, [0] * 4, [pad] * 4], "all padding before a step"
    batch = buffers.batch
    assert isinstance(batch, ForwardBatch) and batch.is_decode and batch.req_to_token is table.table
    for field in (batch.input_ids, batch.positions, batch.seq_lens, batch.slot_mapping, batch.row_ids):
        assert field.shape == (4,) and field.is_contiguous()
        assert field.untyped_storage().data_ptr() == buffers.packed.untyped_storage().data_ptr()

    buffers.load(decode_plan(SEQ_ROWS, [11, 12, 13], [40, 41, 42], [3, 1, 9]))
    assert buffers.packed.tolist() == [[11, 12, 13, 0], [2, 0, 8, 0], [3, 1, 9, 1], [40, 41, 42, 0], [5, 2, 7, pad]]
    expected = torch.zeros(ROWS + 1, CONTEXT, dtype=torch.int64)
    expected[5, 2], expected[2, 0], expected[7, 8] = 40, 41, 42
    assert torch.equal(table.table, expected), "only the new tokens' entries are written; the padding row stays 0"

    buffers.load(decode_plan([1, 0, 3, 6], [1, 2, 3, 4], [50, 51, 52, 53], [1, 2, 3, 32]))
    assert buffers.packed.tolist() == [[1, 2, 3, 4], [0, 1, 2, 31], [1, 2, 3, 32], [50, 51, 52, 53], [1, 0, 3, 6]]
    assert table.table[[1, 0, 3, 6], [0, 1, 2, 31]].tolist() == [50, 51, 52, 53]


@pytest.mark.parametrize("plan,message", [
    (decode_plan([0, 1, 2, 3, 4], [1] * 5, [1] * 5, [1] * 5), "at most 4 sequences"),
    (StepPlan("extend", rows=[0], new_tokens=[[1, 2]], new_slots=[[1, 2]], seq_lens=[2]), "need a decode plan"),
    (StepPlan("decode", rows=[0], new_tokens=[[1, 2]], new_slots=[[1]], seq_lens=[2]), "exactly one new token"),
    (decode_plan([0], [1], [1], [CONTEXT + 1]), f"in [1, {CONTEXT}]"),
    (decode_plan([0], [1], [1], [0]), f"in [1, {CONTEXT}]"),
])
def test_buffers_refuse_what_they_cannot_hold(plan, message):
    table = RequestTable(ROWS, CONTEXT, CPU)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        DecodeBuffers(table, 4).load(plan)
    assert not table.table.any(), "a refused plan records nothing"


@pytest.mark.parametrize("plan,message", [
    (StepPlan("decode", rows=[0], new_tokens=[[1]], new_slots=[[1]], seq_lens=[1], tokens_on_device=True),
     "tokens_on_device is for decode plans without host tokens"),
    (StepPlan("extend", rows=[0], new_slots=[[1]], seq_lens=[1], tokens_on_device=True), "'extend'"),
    (StepPlan("decode", rows=[0, 1], new_tokens=[[1]], new_slots=[[1], [2]], seq_lens=[1, 1]), "2 rows but 1 token"),
])
def test_a_plan_takes_its_tokens_from_one_place(plan, message):
    table = RequestTable(ROWS, CONTEXT, CPU)
    for load in (table.apply, DecodeBuffers(table, 4).load):
        with pytest.raises(ValueError, match=message):
            load(plan)
    assert not table.table.any(), "a refused plan records nothing"


def test_a_mixed_plan_reads_its_decodes_tokens_on_the_device_and_the_chunks_from_the_host():
    """Two decodes ride along with a prefill chunk after a cached prefix of 2 tokens."""
    table = RequestTable(ROWS, CONTEXT, CPU)
    table.commit_tokens(torch.tensor([5, 2]), torch.tensor([11, 12]))
    plan = StepPlan("extend", rows=[5, 2, 7], new_tokens=[[3, 4, 5]], new_slots=[[40], [41], [42, 43, 44]],
                    seq_lens=[3, 1, 5], tokens_on_device=True)
    assert plan.num_device_tokens == 2
    batch, rows = table.apply(plan)
    assert not batch.is_decode and rows.tolist() == [5, 2, 7]
    assert batch.input_ids.tolist() == [11, 12, 3, 4, 5] and batch.positions.tolist() == [2, 0, 2, 3, 4]
    assert batch.extend_lens.tolist() == [1, 1, 3] and batch.seq_lens.tolist() == [3, 1, 5]
    assert table.table[7, 2:5].tolist() == [42, 43, 44] and table.table[5, 2] == 40 and table.table[2, 0] == 41


@pytest.mark.parametrize("new_lens", [[1], [2, 3], [3, 3, 1], [5, 4, 2, 1]])
def test_every_packed_field_of_a_plan_starts_16_byte_aligned(new_lens):
    """Token and sequence counts of any parity leave every integer field 16-byte aligned (the
    kernels that read them then see one pointer-alignment class), with the right values."""
    table = RequestTable(ROWS, CONTEXT, CPU)
    slots = iter(range(1, 100))
    plan = StepPlan("extend", rows=list(range(len(new_lens))), new_tokens=[list(range(n)) for n in new_lens],
                    new_slots=[[next(slots) for _ in range(n)] for n in new_lens], seq_lens=[n + 1 for n in new_lens])
    batch, rows = table.apply(plan)
    fields = (batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.extend_lens, rows)
    assert all(f.data_ptr() % 16 == 0 for f in fields)
    assert batch.extend_lens.tolist() == new_lens and batch.seq_lens.tolist() == [n + 1 for n in new_lens]
    assert batch.slot_mapping.tolist() == list(range(1, sum(new_lens) + 1))


def test_a_sequence_whose_token_is_on_the_device_has_one_new_slot():
    table = RequestTable(ROWS, CONTEXT, CPU)
    plan = StepPlan("extend", rows=[0, 1], new_tokens=[[1, 2]], new_slots=[[1, 2], [3, 4]], seq_lens=[2, 2],
                    tokens_on_device=True)
    with pytest.raises(ValueError, match="exactly one new slot"):
        table.apply(plan)
    assert not table.table.any(), "a refused plan records nothing"


def _decode_both_ways(rank: int, world_size: int) -> dict:
    """Prefill the three prompts, then greedy decode, once through `apply` (gathered rows) and
    once through `DecodeBuffers` of 4 (one padding row) and of 3 (none) in turn, each with its
    own table and KV cache."""
    model = build_model(CONFIG, make_fusion(CONFIG.hidden_size))
    model.load_weights(dummy_weights(CONFIG, seed=5))
    caches = [model.allocate_kv_cache(NUM_SLOTS) for _ in range(2)]
    tables = [RequestTable(ROWS, CONTEXT, CPU) for _ in range(2)]
    buffers = {size: DecodeBuffers(tables[1], size) for size in (3, 4)}
    free = (torch.randperm(NUM_SLOTS - 1, generator=torch.Generator().manual_seed(9)) + 1).tolist()  # not slot 0
    slots = [[free.pop() for _ in range(len(p) + STEPS)] for p in PROMPTS]
    lens = [len(p) for p in PROMPTS]
    prefill = StepPlan("extend", rows=SEQ_ROWS, new_tokens=PROMPTS, new_slots=[s[:n] for s, n in zip(slots, lens)],
                       seq_lens=lens)
    logits = [model(table.apply(prefill)[0], cache).gather() for table, cache in zip(tables, caches)]
    eager, buffered = [logits[0]], [logits[1]]
    for step in range(STEPS):
        tokens = eager[-1].argmax(-1).tolist()
        lens = [n + 1 for n in lens]
        plan = decode_plan(SEQ_ROWS, tokens, [s[n - 1] for s, n in zip(slots, lens)], lens)
        # the buffered side always, the eager side every other step, reads the tokens from the
        # rows' committed last tokens instead of the plan
        on_device = replace(plan, new_tokens=[], tokens_on_device=True)
        for table in tables:
            table.commit_tokens(torch.tensor(SEQ_ROWS), torch.tensor(tokens))
        eager_batch, eager_rows = tables[0].apply(on_device if step % 2 else plan)
        assert eager_rows.tolist() == SEQ_ROWS and eager_batch.input_ids.tolist() == tokens
        eager.append(model(eager_batch, caches[0]).gather())
        step_buffers = buffers[4 if step % 2 else 3]
        step_buffers.load(on_device)
        assert step_buffers.batch.input_ids[:len(tokens)].tolist() == tokens
        buffered.append(model(step_buffers.batch, caches[1]).gather()[:len(PROMPTS)])
    used = torch.tensor([s for seq in slots for s in seq])
    return {"eager": torch.stack(eager), "buffered": torch.stack(buffered),
            "tables_equal": torch.equal(tables[0].table, tables[1].table),
            "k_max_diff": max((a[used] - b[used]).abs().max().item() for a, b in zip(caches[0].k, caches[1].k)),
            "pad_row_zero": not tables[1].table[-1].any()}


def test_model_decodes_through_buffers_as_through_gathered_rows():
    result = run_distributed(_decode_both_ways, world_size=1, timeout_s=60)[0]
    assert result["tables_equal"] and result["pad_row_zero"]
    assert result["k_max_diff"] < 1e-5, result["k_max_diff"]
    assert_close(result["buffered"], result["eager"])
