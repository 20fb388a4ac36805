"""``python -m benchmarks.accuracy``: how close a quantization's next-token predictions are to the ``"fp32"`` path.

Teacher forcing: each text is run once through both models as one prefill, and at every position the two
next-token distributions are compared: top-1 agreement (the argmaxes are equal) and the perplexity of the text
under each (``exp`` of the mean negative log-likelihood of the true next token). The texts are fixed
(``--texts``): ``gsm8k``, GSM8K test rows in file order (question, a blank line, answer,
``../shared/data/gsm8k/test.jsonl``, MIT); ``sonnet``, the vLLM sonnet text (``../shared/data/vllm_sonnet/sonnet.txt``,
public domain) tokenized once and cut into consecutive prompts of ``--chunk-tokens`` tokens; either until at least
``--min-positions`` positions are scored. Because the default path reads exactly the GGUF file's values, the
differences measured are activation rounding (int8 per 32-block) and summation order only. ``--activations
int8,int8x2`` runs each quantization once per activation precision (the engine argument ``quant_activations``), so
one run compares them on the same texts. With ``--kv-cache-dtype bfloat16`` the candidates run over a bfloat16 KV
cache (the reference always over float32), so the rounding of the cache is measured too.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.bench.workloads import default_data_dir


@dataclass
class AccuracyResult:
    """Attributes:
        positions: next-token positions scored.
        top1_agreement: fraction of positions whose argmax is the same in both, 0..1.
        ppl_reference, ppl_candidate: perplexity of the texts under each model.
    """

    positions: int
    top1_agreement: float
    ppl_reference: float
    ppl_candidate: float

    @property
    def ppl_change(self) -> float:
        """``ppl_candidate / ppl_reference - 1``."""
        return self.ppl_candidate / self.ppl_reference - 1


def all_logits(model, ids: list[int], kv_cache_dtype=None) -> torch.Tensor:
    """``[len(ids), V]`` float32 logits of every position of ``ids``, one prefill in a private cache of
    ``kv_cache_dtype`` (default: the model's dtype)."""
    from kvserve.core.sched_output import ScheduledRequest
    from kvserve.batch import build_input_batch
    from kvserve.worker.kv_pool import new_kv_pool

    bs = 16
    n_blocks = -(-len(ids) // bs)
    kv = new_kv_pool(model.kv_cache_shape(n_blocks, bs), kv_cache_dtype or model.dtype)
    batch = build_input_batch([ScheduledRequest("t", ids, 0, list(range(n_blocks)), samples=True)], bs)
    batch.logits_indices = torch.arange(len(ids))
    return model.forward(batch, kv)


def compare(reference, candidate, texts: list[list[int]]) -> AccuracyResult:
    """Teacher-forced comparison of two models (``CausalLM``) over tokenized ``texts`` (each >= 2 tokens)."""
    return compare_all(reference, {"candidate": candidate}, texts)["candidate"]


def compare_all(reference, candidates: dict, texts: list[list[int]], progress_every: int = 0,
                kv_cache_dtypes: dict | None = None) -> dict:
    """``compare`` for several candidates (``{name: CausalLM}``) at once: the reference runs once per text.

    Args:
        kv_cache_dtypes: ``{name: torch.dtype}``, the KV-cache dtype of a candidate (default: its model's dtype;
            the reference always uses its model's).
        progress_every: print the running results every this many texts (0: never), so a long run that is cut
            short still reports what it measured.

    Returns:
        ``{name: AccuracyResult}``.
    """
    agree = dict.fromkeys(candidates, 0)
    nll = dict.fromkeys(candidates, 0.0)
    n, nll_ref = 0, 0.0
    for i, ids in enumerate(texts):
        targets = torch.tensor(ids[1:])[:, None]
        ref = all_logits(reference, ids)[:-1]
        top_ref = ref.argmax(-1)
        nll_ref -= float(ref.log_softmax(-1).gather(1, targets).sum())
        n += len(ids) - 1
        for name, model in candidates.items():
            cand = all_logits(model, ids, (kv_cache_dtypes or {}).get(name))[:-1]
            agree[name] += int((top_ref == cand.argmax(-1)).sum())
            nll[name] -= float(cand.log_softmax(-1).gather(1, targets).sum())
        if progress_every and (i + 1) % progress_every == 0:
            print(f"  {i + 1} texts, {n} positions: " + "; ".join(
                f"{k} top-1 {agree[k] / n:.2%} ppl {math.exp(nll[k] / n) / math.exp(nll_ref / n) - 1:+.2%}"
                for k in candidates), flush=True)
    return {k: AccuracyResult(n, agree[k] / n, math.exp(nll_ref / n), math.exp(nll[k] / n)) for k in candidates}


def gsm8k_texts(tokenizer, min_positions: int, data_dir=None) -> list[list[int]]:
    """Token ids of GSM8K test rows in file order until ``min_positions`` next-token positions are covered.

    Raises:
        ValueError: the data file is missing (its path in the message).
    """
    path = Path(data_dir or default_data_dir()) / "gsm8k" / "test.jsonl"
    if not path.exists():
        raise ValueError(f"{path} not found: --data-dir must point at the shared data folder")
    texts, total = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            ids = tokenizer.encode(row["question"] + "\n\n" + row["answer"])
            texts.append(ids)
            total += len(ids) - 1
            if total >= min_positions:
                break
    return texts


def sonnet_texts(tokenizer, min_positions: int, chunk_tokens: int = 512, data_dir=None) -> list[list[int]]:
    """The tokenized vLLM sonnet text cut into consecutive prompts of ``chunk_tokens`` tokens (the last one
    shorter; a prompt of n tokens scores n - 1 positions), from its start, until ``min_positions`` positions are
    covered or the text ends (6,042 tokens with SmolLM2's tokenizer: 12 prompts of up to 512, 6,030 positions).

    Raises:
        ValueError: the data file is missing (its path in the message).
    """
    path = Path(data_dir or default_data_dir()) / "vllm_sonnet" / "sonnet.txt"
    if not path.exists():
        raise ValueError(f"{path} not found: --data-dir must point at the shared data folder")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    texts, total = [], 0
    for i in range(0, len(ids) - 1, chunk_tokens):
        texts.append(ids[i:i + chunk_tokens])
        total += len(texts[-1]) - 1
        if total >= min_positions:
            break
    return texts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantizations", default="auto,int8", help="compared with fp32, comma-separated")
    p.add_argument("--activations", default=None,
                   help="comma-separated quant_activations values (int8, int8x2, bf16): each quantization once per value "
                        "(default: the engine's --quant-activations only)")
    p.add_argument("--texts", default="gsm8k", choices=("gsm8k", "sonnet"), help="the texts scored")
    p.add_argument("--chunk-tokens", type=int, default=512, help="--texts sonnet: tokens per prompt")
    p.add_argument("--min-positions", type=int, default=20_000)
    p.add_argument("--data-dir", default=None, help="default: ../shared/data next to the repository")
    p.add_argument("--output-json", default=None)
    p.add_argument("--progress-every", type=int, default=0, help="print running results every N texts")


def run(args: argparse.Namespace, engine_args: dict) -> int:
    """Build the fp32 model and each candidate, print agreement and perplexities."""
    from kvserve.engine.llm_engine import LLMEngine

    def engine_for(q: str, kv_cache_dtype: str, activations=None):
        extra = {"quant_activations": activations} if activations else {}
        return LLMEngine.from_engine_args(**{**engine_args, "quantization": q, "num_kv_blocks": 1,
                                             "kv_cache_dtype": kv_cache_dtype, **extra})

    ref = engine_for("fp32", "auto")
    if args.texts == "sonnet":
        texts = sonnet_texts(ref.tokenizer, args.min_positions, args.chunk_tokens, args.data_dir)
    else:
        texts = gsm8k_texts(ref.tokenizer, args.min_positions, args.data_dir)
    kv = engine_args.get("kv_cache_dtype", "auto")
    acts = [a for a in (args.activations or "").split(",") if a] or [None]
    engines = {q + (f"/{a}" if a else ""): engine_for(q, kv, a)
               for q in args.quantizations.split(",") if q for a in acts}
    kv_dtypes = {q: e.kv_cache_dtype for q, e in engines.items()}
    kv_names = {q: e.limits.kv_cache_dtype for q, e in engines.items()}
    results = {}
    for q, r in compare_all(ref.model, {q: e.model for q, e in engines.items()}, texts,
                            progress_every=args.progress_every, kv_cache_dtypes=kv_dtypes).items():
        path = engines[q].model.lm_head.path  # e.g. q8/amx_int8: what ran (fp32_fallback: no kernel)
        results[q] = {**r.__dict__, "ppl_change": r.ppl_change, "kv_cache_dtype": kv_names[q], "lm_head_path": path}
        print(f"{q:>5} (LM head {path}, {kv_names[q]} KV cache, {args.texts}) vs fp32 (float32 KV cache): top-1 agreement {r.top1_agreement:.2%} "
              f"over {r.positions} positions; perplexity {r.ppl_candidate:.3f} vs {r.ppl_reference:.3f} "
              f"({r.ppl_change:+.2%})")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    from benchmarks import engine_main

    raise SystemExit(engine_main("accuracy", __doc__, add_args, run, skip=("quantization",), pass_engine_kwargs=True))
