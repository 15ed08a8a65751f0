"""End-to-end real-mode benchmark against Hugging Face transformers on the same GPU, same weights.

  python benchmarks/e2e.py --model Llama-3.2-1B --num-requests 256 --out e2e.json
1. Builds a random HF checkpoint of the named shape (bf16) and saves it, so ours and transformers
   run identical weights.
2. Correctness: our greedy tokens and their logprobs vs transformers' teacher-forced logprobs
   (bf16 tolerance).
3. Throughput (nano-vllm's benchmark): N requests, input and output lengths uniform in
   [100, 1024], ignore EOS; ours (LLM.generate) vs transformers static-batch `generate` (left
   padded, useful tokens only) and continuous batching `generate_batch` on the same requests.
   Ours runs twice on the same engine: stepping synchronously, then with async scheduling (one step
   in flight, the host work of step N+1 overlapping the GPU work of step N).
   Before each mode, logits processing on the device (check_processing): allowed_token_ids under
   penalties, logit_bias and min_tokens hold, and a request left with no token ends with that error.
4. Decode model-bandwidth utilisation at batch 1 and batch 256 (prompts of 256 and 1024 tokens, 256 out): (weights + KV bytes read per
   decode step) / step time / measured copy bandwidth, from our engine's step records.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from kernels import copy_bandwidth  # benchmarks/kernels.py (scripts run from benchmarks/ on sys.path)
from testbed import LLM, SamplingParams
from testbed.specs.presets import get_model_spec


def make_checkpoint(name: str, folder: str, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = get_model_spec(name).hf_config()
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def workload(n: int, vocab: int, seed: int = 0, lo: int = 100, hi: int = 1024):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def check_correctness(llm: LLM, hf, vocab: int, n_prompts: int = 8, new_tokens: int = 32) -> dict:
    prompts, _ = workload(n_prompts, vocab, seed=1, lo=16, hi=200)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0))
    max_diff, agree, total = 0.0, 0, 0
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        ids = torch.tensor([p + toks], device=hf.device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, -1)
        ref = lp.gather(1, torch.tensor(toks, device=hf.device)[:, None])[:, 0].tolist()
        ours = [pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, toks)]  # {token id: Logprob} per position
        max_diff = max(max_diff, max(abs(a - b) for a, b in zip(ours, ref)))
        agree += sum(int(a == b) for a, b in zip(toks, logits.argmax(-1).tolist()))
        total += len(toks)
    return {"prompts": n_prompts, "new_tokens": new_tokens, "max_abs_logprob_diff": max_diff,
            "greedy_agreement": agree / total}


def check_processing(llm: LLM, vocab: int) -> dict:
    """Logits processing on the device, in the engine's current scheduling mode: constraints that hold whatever
    the weights (allowed_token_ids under three penalties, a dominating logit_bias, min_tokens) on rows processed
    beside plain ones, then a request whose constraints leave no token: it ends with that error, and the engine goes on."""
    prompts, _ = workload(4, vocab, seed=2, lo=16, hi=64)
    allowed, forced, n = set(range(2000, 2100)), 4242, 12
    params = [SamplingParams(temperature=0, max_tokens=n, allowed_token_ids=sorted(allowed), presence_penalty=1.5,
                             frequency_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=n, logit_bias={forced: 100.0}),
              SamplingParams(temperature=1.0, seed=7, max_tokens=n, min_tokens=n, allowed_token_ids=[llm.eos_token_id, 7]),
              SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    checks = {"allowed_with_penalties": set(outs[0]) <= allowed and len(outs[0]) == n,
              "logit_bias": outs[1] == [forced] * n, "min_tokens": outs[2] == [7] * n,
              "plain_row_beside": len(outs[3]) == n}
    stuck = llm.generate(prompts[:1], SamplingParams(max_tokens=4, allowed_token_ids=[llm.eos_token_id], min_tokens=2),
                         use_tqdm=False)[0].outputs[0]
    checks["no_token_left_refused"] = stuck.finish_reason == "error" and "no token is left" in str(stuck.stop_reason)
    again = llm.generate(prompts[:1], params[3], use_tqdm=False)[0].outputs[0].token_ids
    checks["engine_goes_on"] = len(again) == n
    return checks


def bench_ours(llm: LLM, prompts, outs) -> dict:
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    llm.generate(prompts[:2], sps[:2])  # warm-up (Triton compile)
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(prompts, sps)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}


def bench_hf_static(hf, prompts, outs, batch: int) -> dict:
    total_t, useful = 0.0, 0
    for s in range(0, len(prompts), batch):
        ps, os_ = prompts[s:s + batch], outs[s:s + batch]
        L = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (L - len(p)) + p for p in ps], device=hf.device)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps], device=hf.device)
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                    do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        total_t += time.perf_counter() - t
        useful += sum(os_)
    return {"seconds": total_t, "output_tokens": useful, "output_tok_s": useful / total_t, "batch": batch}


def bench_hf_cb(hf, prompts, max_new: int) -> dict:
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = hf.generate_batch(inputs=prompts, generation_config=gc)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = sum(len(r.generated_tokens) for r in res.values())
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt, "requests": len(prompts), "max_new_tokens": max_new}


def batch_steps(llm: LLM, batch: int, prompt_len: int, out_len: int) -> dict:
    """Run `batch` requests (`prompt_len` tokens, `out_len` greedy tokens each) to completion; the step columns of
    the steps they took."""
    prompts = [[1000 + (i * 7 + j) % 20000 for j in range(prompt_len)] for i in range(batch)]
    start = len(llm.engine.records.steps)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    return {k: v[start:] for k, v in llm.engine.records.step_columns().items()}


def decode_steps(llm: LLM, batch: int, prompt_len: int, out_len: int):
    """Run `batch` requests to completion; (durations, context tokens) of their pure decode steps at full batch."""
    steps = batch_steps(llm, batch, prompt_len, out_len)
    dec = (steps["num_prefill_tokens"] == 0) & (steps["num_reqs"] == batch)
    return steps["duration"][dec], steps["sum_context_tokens"][dec]


def decode_mbu(llm: LLM, spec, batch: int, bw: float, prompt_len: int = 256, out_len: int = 256) -> dict:
    import numpy as np
    dur, ctx = decode_steps(llm, batch, prompt_len, out_len)
    bytes_per_step = spec.num_params * 2 + ctx * spec.kv_bytes_per_token(2)
    mbu = bytes_per_step / dur / bw
    return {"batch": batch, "prompt_len": prompt_len, "out_len": out_len, "decode_steps": len(dur),
            "mean_context": float(ctx.mean() / batch), "step_ms_median": float(np.median(dur) * 1e3),
            "gbytes_per_step_median": float(np.median(bytes_per_step) / 1e9),
            "mbu_median": float(np.median(mbu)), "copy_bandwidth": bw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.2-1B")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-cb-requests", type=int, default=256)
    ap.add_argument("--hf-static-batch", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = get_model_spec(args.model)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": spec.name,
              "date": time.strftime("%Y-%m-%d")}
    import transformers
    import triton
    result["transformers"], result["triton"] = transformers.__version__, triton.__version__
    result["copy_bandwidth"] = bw = copy_bandwidth(1.0, 20) * 1e9  # B/s, read + write
    with tempfile.TemporaryDirectory() as folder:
        hf = make_checkpoint(spec.name, folder, dev)
        llm = LLM(folder, skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=16384,
                  max_model_len=4096, gpu_memory_utilization=0.6)
        result["num_gpu_blocks"] = llm.executor.num_gpu_blocks
        result["correctness"] = check_correctness(llm, hf, spec.vocab_size)
        print(json.dumps(result["correctness"]), flush=True)
        prompts, outs = workload(args.num_requests, spec.vocab_size)
        for mode in (False, True):  # the same engine stepping without, then with async scheduling
            llm.stepper.async_scheduling = mode
            key = "_async" if mode else "_sync"
            result["processing" + key] = check_processing(llm, spec.vocab_size)
            print("processing" + key, json.dumps(result["processing" + key]), flush=True)
            result["ours" + key] = bench_ours(llm, prompts, outs)
            print("ours" + key, json.dumps(result["ours" + key]), flush=True)
            result["mbu" + key] = [decode_mbu(llm, spec, b, bw, prompt_len=p)
                                   for b, p in ((1, 256), (256, 256), (256, 1024))]
            print("mbu" + key, json.dumps(result["mbu" + key]), flush=True)
        result["ours"] = max(result["ours_sync"], result["ours_async"], key=lambda r: r["output_tok_s"])
        del llm
        torch.cuda.empty_cache()
        if not args.skip_hf:
            result["hf_static"] = bench_hf_static(hf, prompts, outs, args.hf_static_batch)
            print("hf_static", json.dumps(result["hf_static"]), flush=True)
            n = args.hf_cb_requests
            result["hf_generate_batch"] = bench_hf_cb(hf, prompts[:n], max_new=max(outs[:n]))
            print("hf_cb", json.dumps(result["hf_generate_batch"]), flush=True)
            best = max(result["hf_static"]["output_tok_s"], result["hf_generate_batch"]["output_tok_s"])
            result["speedup_vs_best_hf"] = result["ours"]["output_tok_s"] / best
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
