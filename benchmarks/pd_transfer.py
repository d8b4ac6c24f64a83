"""P/D transfer: bytes and time per prompt length, TTFT through the proxy against one mixed
instance, and the bytes of whole-block transfers against row re-sharding.

    python benchmarks/pd_transfer.py            # tiny Qwen3 checkpoint, prompts of 17..1025 tokens
    python benchmarks/pd_transfer.py --quick    # prompts of 9, 33, 130 tokens, 2 reps

Three ``dcpgraph serve`` instances of one checkpoint (fp64, block size 4): a producer at tp=2/dcp=1,
a consumer at tp=2/dcp=2 with ``interleave == block_size`` (whole blocks move), both behind
``dcpgraph proxy``, and a mixed instance at tp=2/dcp=2 without ``--kv-transfer-config``. Per prompt
length and rep (fresh random prompts, no prefix caching, the two paths interleaved): TTFT = request
sent → first streamed token, through the proxy and on the mixed instance; the consumer's
``/kv_transfer/stats`` gives the bytes it received and the transfer's wall time (ask → every rank
received). Bytes of the same transfer to a consumer at ``interleave=1`` (rows re-sharded) come from
the transfer plan itself (:mod:`dcpgraph.serving.kv_connector.plan`, exact): whole blocks carry
the unwritten tail of the last block, rows do not. Records: ``benchmarks/results/pd_transfer.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

from common import load_note, record, stop_servers_on_sigterm, write

NAME = "pd_transfer"
BLOCK = 4


def plan_bytes(model_dir: str, lengths: list[int]) -> dict[str, list[int]]:
    """Bytes moved (all pairs) for each length: to a block-interleaved and to a row-interleaved consumer."""
    import dcpgraph
    from dcpgraph.checkpoints.model_dir import load_model
    from dcpgraph.serving.kv_connector.plan import KVSide, block_mode, buffer_bytes, transfer_plan

    program = dcpgraph.trace(load_model(model_dir, "float64"))
    side = lambda **kw: KVSide.of_engine(dcpgraph.compile(program, block_size=BLOCK, num_blocks=1, **kw))  # noqa: E731
    producer = side(tp=2, dcp=1)
    out = {}
    for name, consumer in (("blocks", side(tp=2, dcp=2, interleave=BLOCK)), ("rows", side(tp=2, dcp=2, interleave=1))):
        blocks = block_mode(producer, consumer)
        out[name] = [sum(buffer_bytes(consumer, p.dst, p, producer, p.src, blocks)
                         for p in transfer_plan(producer, consumer, 0, n)) for n in lengths]
    return out


def first_token_s(url: str, prompt: str) -> float:
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    began, ttft = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end, timing the first token
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - began
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft


def main(argv: list[str] | None = None) -> int:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prompts of 9, 33, 130 tokens, 2 reps")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    from dcpgraph.testing.checkpoints import save_tiny_checkpoint
    from dcpgraph.testing.pd import kv_config, kv_stats
    from dcpgraph.testing.server import free_port, running_dcpgraph, running_server

    lengths = [9, 33, 130] if args.quick else [17, 65, 257, 1025]  # not block multiples: see the tail
    reps = args.reps or (2 if args.quick else 4)
    max_len = str(max(lengths) + 16)
    common_args = ("--dtype", "float64", "--block-size", str(BLOCK), "--max-model-len", max_len,
                   "--served-model-name", "tiny", "-tp", "2")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_checkpoint(f"{tmp}/qwen3", "qwen3")
        planned = plan_bytes(model, lengths)
        port = free_port()
        with running_server(model, *common_args, "--kv-transfer-config", kv_config("kv_producer", 0, 2, port),
                            log_path=f"{tmp}/p.log") as p, \
                running_server(model, *common_args, "-dcp", "2", "--cp-kv-cache-interleave-size", str(BLOCK),
                               "--kv-transfer-config", kv_config("kv_consumer", 1, 2, port), log_path=f"{tmp}/d.log") as d, \
                running_server(model, *common_args, "-dcp", "2", "--cp-kv-cache-interleave-size", str(BLOCK),
                               log_path=f"{tmp}/m.log") as mixed, \
                running_dcpgraph("proxy", "--prefill", p.url, "--decode", d.url, log_path=f"{tmp}/proxy.log") as proxy:
            first_token_s(proxy.url, "warm up")
            first_token_s(mixed.url, "warm up")
            rows = []
            for n, blocks_bytes, rows_bytes in zip(lengths, planned["blocks"], planned["rows"]):
                pd, mix, moved, seconds = [], [], [], []
                for _ in range(reps):
                    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
                    before = kv_stats(d)
                    pd.append(first_token_s(proxy.url, prompt))
                    after = kv_stats(d)
                    moved.append(after["bytes_received"] - before["bytes_received"])
                    seconds.append(after["last_transfer_s"])
                    mix.append(first_token_s(mixed.url, "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))))
                assert set(moved) == {blocks_bytes}, f"the consumer received {moved}, the plan says {blocks_bytes}"
                rows.append((n, blocks_bytes, rows_bytes, statistics.median(seconds), statistics.median(pd),
                             statistics.median(mix)))
                print(f"prompt {n:5d} tokens: {blocks_bytes / n:9.1f} B/token moved ({blocks_bytes} B, rows would be "
                      f"{rows_bytes} B), transfer {rows[-1][3] * 1e3:7.1f} ms, TTFT via proxy "
                      f"{rows[-1][4] * 1e3:7.1f} ms vs mixed {rows[-1][5] * 1e3:7.1f} ms", flush=True)
    config = f"qwen3-tiny fp64 block={BLOCK} P tp2/dcp1 -> D tp2/dcp2 interleave={BLOCK} reps={reps} {load_note()}"
    records = []
    for n, blocks_bytes, rows_bytes, transfer, pd, mix in rows:
        c = f"{config} prompt={n}"
        records.append(record(NAME, c, "transfer_bytes_per_token", blocks_bytes / n, "B/token"))
        records.append(record(NAME, c, "transfer_time", transfer, "s"))
        records.append(record(NAME, c, "ttft_via_proxy", pd, "s", baseline=mix))
        records.append(record(NAME, c, "bytes_whole_blocks", blocks_bytes, "B", baseline=rows_bytes))
    print(f"wrote {write(NAME, records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
