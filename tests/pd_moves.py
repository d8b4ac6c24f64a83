"""The P/D hand-over by hand in one process, as the connector does it between processes: prefill
on a producer engine, adopt on a consumer engine, and move every (producer rank, consumer rank)
buffer of the transfer plan with ``gather``/``scatter`` (ranks are global ranks of each side's
``tp·pcp`` world)."""

from __future__ import annotations

from dcpgraph.serving.kv_connector.plan import (
    KVSide,
    block_mode,
    buffer_bytes,
    check_compatible,
    gather,
    scatter,
    transfer_plan,
)


def move(p_engine, c_engine, prompt, new):
    """Prefill ``prompt`` on ``p_engine`` to its first token and hand it over to ``c_engine`` by the
    plan; returns (consumer rid, tokens the producer sampled, start, bytes moved, block mode)."""
    rid = p_engine.add_request(prompt, 2)
    while not p_engine.scheduler.get(rid).output:
        p_engine.step()
    tokens, computed, prompt_len = p_engine.hold_for_transfer(rid)
    c_rid, start = c_engine.adopt_transferred(tokens[:prompt_len], tokens[prompt_len:], new)
    producer, consumer = KVSide.of_engine(p_engine), KVSide.of_engine(c_engine)
    check_compatible(producer, consumer)
    blocks = block_mode(producer, consumer)
    p_table, c_table = p_engine.blocks.table(rid), c_engine.blocks.table(c_rid)
    caches_p = {r: [p_engine.executor.rank_caches(r)[c.name] for c in p_engine.program.caches]
                for r in range(producer.ranks)}
    caches_c = {r: [c_engine.executor.rank_caches(r)[c.name] for c in c_engine.program.caches]
                for r in range(consumer.ranks)}
    moved = 0
    for pair in transfer_plan(producer, consumer, start, computed):
        buf = gather(producer, pair.src, caches_p[pair.src], p_table, pair, consumer, blocks)
        assert len(buf) == buffer_bytes(consumer, pair.dst, pair, producer, pair.src, blocks)
        scatter(consumer, pair.dst, caches_c[pair.dst], c_table, pair, producer, blocks, buf)
        moved += len(buf)
    assert p_engine.release_held(rid) and p_engine.blocks.free_blocks == p_engine.blocks.num_blocks
    return c_rid, tokens[prompt_len:], start, moved, blocks
