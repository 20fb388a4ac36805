"""Per-step cost of grammar masks: ``python -m benchmarks.structured [--batch 16] [--steps 40]``.

Drives ``batch`` JSON-schema matchers along a real JSON text (one token per step, as decoding does) and times,
per step: xgrammar's bitmask fill of every row plus applying it to ``[batch, V]`` logits (what
``Sampler._apply_grammar_masks`` adds to a step), and — when installed — llguidance's fill of the same rows, the
alternative backend. With ``--engine``, also the whole engine: ``batch`` chat requests decoding exactly
``--tokens`` tokens each (``min_tokens = max_tokens``) without and with a regex grammar, run alternately
(``--repeats`` pairs), reporting the wall time per decode step of each. Numbers for this machine live in
docs/structured_outputs.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TEXT = '{"name": "Bob Smith", "age": 42, "tags": ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]}'


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="tokens per matcher (at most the text's length)")
    ap.add_argument("--engine", action="store_true", help="also time engine steps with and without a grammar")
    ap.add_argument("--tokens", type=int, default=32, help="(--engine) tokens per request")
    ap.add_argument("--repeats", type=int, default=2, help="(--engine) alternating plain/grammar pairs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kvserve.model.loader import load_model
    from kvserve.structured import StructuredOutputsParams
    from kvserve.structured.backend import GrammarBackend, apply_bitmask, bitmask_for

    loaded = load_model()
    tok, v = loaded.tokenizer, loaded.arch.vocab_size
    ids = tok.encode(TEXT)[: args.steps]
    backend = GrammarBackend(tok, v, loaded.eos_token_ids)
    compiled = backend.compile(StructuredOutputsParams(json=SCHEMA))
    states = [backend.new_state(compiled) for _ in range(args.batch)]
    logits = torch.randn(args.batch, v)
    fill = apply = 0.0
    for t in ids:
        t0 = time.perf_counter()
        bitmask, rows = bitmask_for(states, v)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask, rows)
        t2 = time.perf_counter()
        fill, apply = fill + t1 - t0, apply + t2 - t1
        for s in states:
            assert s.matcher.accept_token(t)
    n = len(ids)
    print(f"xgrammar   batch {args.batch}, V {v}: fill {fill / n * 1e3:.3f} ms/step "
          f"({fill / n / args.batch * 1e6:.1f} us/row), apply {apply / n * 1e3:.3f} ms/step, "
          f"total {(fill + apply) / n * 1e3:.3f} ms/step over {n} steps")
    if args.engine:
        engine_steps(args.batch, args.tokens, args.repeats)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
    except ImportError:
        print("llguidance not installed: skipped")
        return
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=v)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(ltok, grammar) for _ in range(args.batch)]
    bitmask = lt.allocate_token_bitmask(args.batch, v)
    fill = 0.0
    for t in ids:
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            lt.fill_next_token_bitmask(m, bitmask, i)
        fill += time.perf_counter() - t0
        for m in matchers:
            assert m.consume_token(t)
    print(f"llguidance batch {args.batch}, V {v}: fill {fill / n * 1e3:.3f} ms/step "
          f"({fill / n / args.batch * 1e6:.1f} us/row) over {n} steps")


def engine_steps(batch: int, tokens: int, repeats: int) -> None:
    """Wall ms per engine step (prefill excluded: timed from the first decode step), plain vs grammar."""
    from kvserve import LLM, SamplingParams
    from kvserve.structured import StructuredOutputsParams

    llm = LLM(max_num_seqs=batch)
    engine = llm.llm_engine
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Write about topic number {i}."}])
               for i in range(batch)]
    grammar = StructuredOutputsParams(regex=r"[A-Za-z ,.'\n-]*")
    times: dict = {"plain": [], "grammar": []}
    for _ in range(repeats):
        for name, so in (("plain", None), ("grammar", grammar)):
            sp = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, structured_outputs=so)
            for p in prompts:
                engine.add_request(p, sp)
            engine.step()  # the prompts' prefill (and first tokens)
            t0, steps = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    plain, gram = min(times["plain"]), min(times["grammar"])
    print(f"engine     batch {batch}, {tokens} tokens/request: plain {plain:.1f} ms/step, grammar {gram:.1f} "
          f"ms/step (+{(gram - plain) / plain * 100:.1f}%), best of {repeats} alternating runs")


if __name__ == "__main__":
    main()
