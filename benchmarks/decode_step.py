"""The whole decode step against the memory-bandwidth limit, and against HF ``generate``
(targets in docs/benchmarks.md).

A decode step must read every weight once and every cached K/V byte of its batch once, so its
physical floor is ``bytes moved per step ÷ read bandwidth``. One run measures, on the same
machine, process and thread count (1; the machine is shared):

* ``read``: plain read bandwidth, ``x.sum()`` over a buffer as large as the weights (far over the
  caches), best of the rounds;
* the engine's decode step time (tp=1, eager) and HF ``generate``'s on the same weights, batch 1
  and batch 16, fp32 and bf16, by subtraction: ``(T(N new tokens) − T(1)) / (N − 1)`` removes
  prefill and per-call setup (process CPU time, each variant's minimum over interleaved rounds);
* bytes per step: every parameter except the input embedding table (a step reads ``batch`` of its
  rows), plus the KV cache read (``batch × mean context × KV bytes per token``, the engine's
  ``memory_report``) and written (one token per request);
* ``bandwidth_fraction`` = (bytes per step ÷ step time) ÷ read: the share of the read bandwidth
  the step achieves (target ≥ 0.70), and the engine's decode tokens/s ÷ HF's (target ≥ 1.5).

Linears: the engine's bf16 program runs them through ``dcpgraph.linear_bf16`` (pass
``native_linear``: AMX or AVX512-BF16 kernels for ≤ 16 rows, :mod:`dcpgraph.ops.linear`); HF keeps
torch's own linear, which is the comparison. The config string says which (``linear=``). fp32 is
untouched. fp32 at batch 16 is bound by multiply-adds, not bytes: at memory speed a step would
need (read GB/s ÷ 4 bytes) × 16 MACs per weight, ≈ 52 GMAC/s at 13 GB/s, while torch's fp32
few-row GEMM sustains ~21 GMAC/s on one core while streaming (85 GMAC/s cache-resident peak), so
it stays near 40%.

``--profile N``: after measuring, a ``torch.profiler`` table (self CPU time per op) of N engine
decode steps per configuration, to show what besides the linears a step spends time on.

The model is Qwen3-shaped with random weights and no EOS: 12 layers, hidden 1024, 16 query / 4 KV
heads of 64, MLP 2816, vocab 32000, untied (≈ 200M parameters). ``--quick``: 4 layers, hidden 512,
vocab 8192 (≈ 25M), for the default ``benchmarks/run.py`` run. Greedy tokens of both are compared.

``--device cuda``: the model, caches and the read buffer on the GPU, wall-clock timing with
``torch.cuda.synchronize()`` (no GPU figures exist yet: none was available where this was written).

    python3 benchmarks/decode_step.py [--quick] [--device cuda] [--profile N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import dcpgraph  # noqa: E402

NAME = "decode_step"
PROMPT = 8
FULL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64)
QUICK = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)
BANDWIDTH_TARGET = 0.70
HF_TARGET = 1.5


def build_model(shape: dict, dtype: torch.dtype):
    import transformers as tf

    cfg = tf.Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def weight_bytes_per_step(model, batch: int) -> int:
    """Every parameter once, except the embedding table, of which ``batch`` rows are read."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()


class Clock:
    """Process CPU time on the host (the machine is shared); synchronised wall time on a GPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()


def read_bandwidth(nbytes: int, rounds: int, device: str, clock: Clock) -> float:
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    buf.sum()
    best = float("inf")
    for _ in range(rounds):
        c0 = clock()
        buf.sum()
        best = min(best, clock() - c0)
    return buf.numel() * 4 / best


def linear_path(engine) -> str:
    """How the engine's program runs its linears: ``torch``, or ``native-amx``/``native-dot``
    (the kernel ``dcpgraph.linear_bf16`` picks for decode rows on this machine)."""
    targets = {str(n.target) for n in engine.program.graph_module.graph.nodes if n.op == "call_function"}
    if "dcpgraph.linear_bf16.default" not in targets:
        return "torch"
    from dcpgraph.ops import linear

    return "native-amx" if linear._state.get("amx") else "native-dot"


def profile_steps(engine, prompts: list[list[int]], steps: int) -> None:
    """Print a torch.profiler table of ``steps`` decode steps (prefill run before profiling)."""
    from torch.profiler import ProfilerActivity, profile

    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=steps + 1)
    engine.step()  # prefill (and the first token), outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.scheduler.has_work():
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)


def measure(model, dtype_name: str, batch: int, new: int, rounds: int, shape_name: str, device: str,
            profile: int = 0) -> list[dict]:
    clock = Clock(device)
    program = dcpgraph.trace(model)
    engine = dcpgraph.compile(program, backend="eager", max_num_seqs=batch, max_num_batched_tokens=PROMPT * batch,
                              max_model_len=PROMPT + new + 8, kv_cache_tokens=(PROMPT + new + 16) * batch)
    prompts = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    prompts = prompts.to(device)
    outputs = {}

    def hf(n):
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                                 do_sample=False, use_cache=True, pad_token_id=0)
        outputs["hf"] = out[:, PROMPT:].tolist()

    def eng(n):
        outputs["engine"] = engine.generate(prompts.tolist(), max_new_tokens=n)

    fns = {"engine_N": lambda: eng(new), "engine_1": lambda: eng(1), "hf_N": lambda: hf(new), "hf_1": lambda: hf(1)}
    for fn in fns.values():
        fn()  # warm-up
    best = {k: float("inf") for k in fns}
    read_bw = 0.0
    weights = weight_bytes_per_step(model, batch)
    for _ in range(rounds):
        for k, fn in fns.items():
            c0 = clock()
            fn()
            best[k] = min(best[k], clock() - c0)
        read_bw = max(read_bw, read_bandwidth(weights, 1, device, clock))  # interleaved with the steps it divides
    eng(new)
    hf(new)
    same = sum(a == b for ra, rb in zip(outputs["engine"], outputs["hf"]) for a, b in zip(ra, rb))
    step = {s: (best[f"{s}_N"] - best[f"{s}_1"]) / (new - 1) for s in ("engine", "hf")}
    kv_token = engine.memory_report()["kv_bytes_per_token"]
    mean_context = PROMPT + new / 2
    moved = weights + batch * (mean_context + 1) * kv_token
    frac = {s: moved / step[s] / read_bw for s in step}
    clock_name = "cuda-wall" if clock.cuda else "cpu"
    if profile:
        print(f"{shape_name} {dtype_name} batch {batch}: {profile} decode steps profiled", flush=True)
        profile_steps(engine, prompts.tolist(), profile)
    config = (f"{shape_name} {dtype_name} {device} tp=1 eager batch={batch} prompt={PROMPT} new={new} threads=1 clock={clock_name} "
              f"linear={linear_path(engine)} "
              f"min-of-{rounds} weights={weights / 2**20:.0f}MiB greedy-match={same}/{batch * new} "
              f"{common.load_note()}")
    rec = common.record(NAME, config, "bandwidth_fraction", frac["engine"], "fraction", baseline=frac["hf"],
                        bytes_per_step=moved, step_ms=step["engine"] * 1e3, hf_step_ms=step["hf"] * 1e3,
                        read_gbps=read_bw / 1e9)
    common.with_target(rec, f"≥ {BANDWIDTH_TARGET:.0%} of read bandwidth", frac["engine"] >= BANDWIDTH_TARGET,
                       f"at {frac['engine']:.0%} ({moved / 1e6:.0f} MB per step in {step['engine'] * 1e3:.1f} ms; "
                       f"the floor at {read_bw / 1e9:.1f} GB/s is {moved / read_bw * 1e3:.1f} ms)")
    speedup = step["hf"] / step["engine"]
    vs_hf = common.record(NAME, config, "decode_tokens_per_s", batch / step["engine"], "tok/s",
                          baseline=batch / step["hf"])
    common.with_target(vs_hf, f"≥ {HF_TARGET}× HF generate", speedup >= HF_TARGET, f"{speedup:.2f}× HF generate")
    print(f"{shape_name} {dtype_name} batch {batch}: engine {step['engine'] * 1e3:.1f} ms/step "
          f"({frac['engine']:.0%} of read), HF {step['hf'] * 1e3:.1f} ms/step ({frac['hf']:.0%}); floor "
          f"{moved / read_bw * 1e3:.1f} ms at {read_bw / 1e9:.1f} GB/s; greedy equal {same}/{batch * new}", flush=True)
    return [rec, vs_hf, common.record(NAME, config, "read_bandwidth", read_bw / 1e9, "GB/s", digits=4)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ≈25M-parameter model, fewer tokens and rounds")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print a torch.profiler table of N decode steps per configuration")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    shape, shape_name = (QUICK, "qwen3-25M") if args.quick else (FULL, "qwen3-200M")
    new = args.new_tokens or (8 if args.quick else 16)
    rounds = args.rounds or (2 if args.quick else 3)
    torch.set_num_threads(1)
    start = time.perf_counter()
    records = []
    for dtype_name in args.dtypes:
        model = build_model(shape, torch.float32 if dtype_name == "fp32" else torch.bfloat16).to(args.device)
        params = sum(p.numel() for p in model.parameters())
        print(f"{shape_name}: {params / 1e6:.0f}M parameters, {dtype_name}", flush=True)
        for batch in args.batches:
            records += measure(model, dtype_name, batch, new, rounds, shape_name, args.device, args.profile)
        del model
    return common.finish(NAME, records, start)


if __name__ == "__main__":
    sys.exit(main())
