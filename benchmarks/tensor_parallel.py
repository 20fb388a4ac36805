"""Step time of one engine configuration (``python -m benchmarks.tensor_parallel --tensor-parallel-size T ...``):
``--batch`` requests of ``--prompt-len`` random token ids, each decoding ``--max-tokens`` tokens (EOS ignored via
``min_tokens``). Prints the prefill time (the steps until every request has its first token) and the median
decode step time. Run it once per ``T`` side by side to compare; numbers: docs/scale_out.md, "Tensor parallelism"."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    from kvserve.engine.arg_utils import add_engine_args, engine_kwargs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling_params import SamplingParams

    p = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__)
    add_engine_args(p, skip=("speculative_config",))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs after one warm-up run; the best is reported")
    args = p.parse_args(argv)
    engine = LLMEngine.from_engine_args(**engine_kwargs(args))
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    prefills, decodes = [], []
    for run in range(args.repeats + 1):
        for _ in range(args.batch):  # fresh ids each run: no prefix-cache hits
            engine.add_request(rng.integers(3, engine.arch.vocab_size, args.prompt_len).tolist(), sp)
        steps = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            steps.append((time.perf_counter() - t, sum(len(o.outputs[0].token_ids) == 1 for o in outs)))
        started = np.cumsum([n for _, n in steps])
        first = int(np.argmax(started >= args.batch)) + 1  # steps until every request has its first token
        if run:
            prefills.append(sum(s for s, _ in steps[:first]))
            decodes.append(statistics.median(s for s, _ in steps[first:]))
    engine.shutdown()
    tp = engine.config.parallel_config.tensor_parallel_size
    print(f"tensor_parallel_size={tp} batch={args.batch} prompt_len={args.prompt_len}: prefill "
          f"{min(prefills) * 1e3:.1f} ms, decode step {min(decodes) * 1e3:.2f} ms (median; best of {args.repeats})")


if __name__ == "__main__":
    main()
