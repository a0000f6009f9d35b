"""The model runner alone on the bundled demo model: the inputs it builds from a scheduled batch (token ids,
positions, cache slots, the rows to sample), logits only for the rows that sample, and a prompt computed in chunks
giving the logits of one computed whole (the KV pages carry the context). No engine, no scheduler policy."""

from __future__ import annotations

import pytest
import torch

from cotserve.worker.block_manager import BlockManager
from cotserve.worker.config import DEMO_MODEL
from cotserve.worker.kv_spec import KvCacheSpec
from cotserve.worker.model_runner import ModelRunner
from cotserve.worker.models.loader import load_model
from cotserve.worker.scheduler import ScheduledBatch, ScheduledSeq
from cotserve.worker.sequence import SamplingParams, Sequence

BLOCKS, BS = 16, 4


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL, device=torch.device("cpu"))


def runner_and_pool(demo) -> tuple[ModelRunner, BlockManager]:
    spec = KvCacheSpec.resolve(demo.config, demo.dtype, "auto", BS, (), 0, ())
    return ModelRunner(demo, BLOCKS, spec), BlockManager(BLOCKS, BS)


def scheduled(bm: BlockManager, seq: Sequence, n: int) -> ScheduledSeq:
    bm.allocate(seq, seq.num_computed_tokens + n)
    return ScheduledSeq(seq, n)


def test_inputs_carry_each_tokens_id_position_and_slot_and_only_sampling_rows_get_logits(demo):
    runner, bm = runner_and_pool(demo)
    prompt = demo.tokenizer.encode("37+48-12=").ids
    a = Sequence("a", prompt, SamplingParams())
    b = Sequence("b", prompt[:3], SamplingParams())
    batch = ScheduledBatch([scheduled(bm, a, 4), scheduled(bm, b, 3)])  # a: a chunk (no sample), b: its whole prompt
    inputs = runner.prepare_inputs(batch)
    assert inputs.input_ids.tolist() == prompt[:4] + prompt[:3]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert inputs.paged.slot_mapping.tolist() == [a.block_table[0] * BS + i for i in range(4)] + \
        [b.block_table[0] * BS + i for i in range(3)]
    assert inputs.sample_rows.tolist() == [6]  # b's last token only: a has prompt tokens left
    logits = runner.execute(batch)
    assert logits.shape == (1, demo.config.vocab_size) and logits.dtype == torch.float32


def test_a_prompt_in_chunks_ends_with_the_logits_of_the_whole_prompt(demo):
    prompt = demo.tokenizer.encode("12+30-7+5+61-20=").ids
    runner, bm = runner_and_pool(demo)
    whole = Sequence("whole", prompt, SamplingParams())
    one_shot = runner.execute(ScheduledBatch([scheduled(bm, whole, len(prompt))]))
    runner, bm = runner_and_pool(demo)
    chunked = Sequence("chunked", prompt, SamplingParams())
    assert len(prompt) > 8
    for n in (4, 3, len(prompt) - 7):
        logits = runner.execute(ScheduledBatch([scheduled(bm, chunked, n)]))
        chunked.num_computed_tokens += n
    assert torch.allclose(logits, one_shot, atol=1e-4)
    assert logits.argmax().item() == one_shot.argmax().item()
